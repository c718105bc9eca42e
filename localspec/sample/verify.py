"""Verification of drafted tokens (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"), and its keyed form for seeded requests. Pure functions on numpy arrays; names
follow the paper:

  gamma  number of drafted tokens
  q      draft distributions, shape (gamma, V): q[i] is what draft token i was sampled from
  p      target distributions, shape (gamma + 1, V): p[i] is the target's distribution for the
         position of draft token i; p[gamma] is the bonus position after all drafts

Both return (n_accepted, next_token): the first n_accepted drafts are kept, then next_token is
the target's own token (the correction after a rejection, or the bonus after full acceptance), or
NO_TOKEN where that row leaves no token to emit (logit_bias and a grammar exclude every one): a
draft is never accepted at such a row, and the answer cannot go on past it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from localspec.sample.sampling import Draws, sample

NO_TOKEN = -1  # a verify row that leaves no token: its argmax entry, or its all-zero row of p


def greedy_verify(draft_tokens: Sequence[int], target_argmax: Sequence[int]) -> tuple[int, int]:
    """Accept while the draft token is the target's argmax; then one token of the target's.

    target_argmax has gamma + 1 entries (one per verified row; NO_TOKEN for a row that leaves none)."""
    gamma = len(draft_tokens)
    if len(target_argmax) != gamma + 1:
        raise ValueError("target_argmax needs gamma + 1 entries")
    n = 0
    while n < gamma and int(draft_tokens[n]) == int(target_argmax[n]):
        n += 1
    return n, int(target_argmax[n])


def speculative_sampling(
    draft_tokens: Sequence[int],
    q: np.ndarray,
    p: np.ndarray,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Accept draft x_i with probability min(1, p_i(x)/q_i(x)); on the first rejection sample from
    norm(max(0, p_i - q_i)); if all gamma are accepted, sample a bonus token from p_gamma.

    The emitted tokens are distributed exactly as sampling from p one token at a time. An all-zero row of p
    (no token left) rejects its draft, and next_token is then NO_TOKEN."""
    gamma = len(draft_tokens)
    if p.shape[0] != gamma + 1 or (gamma and q.shape[0] < gamma):
        raise ValueError("need q with gamma rows and p with gamma + 1 rows")
    for i in range(gamma):
        if not p[i].any():
            return i, NO_TOKEN
        x = int(draft_tokens[i])
        px = float(p[i, x])
        qx = float(q[i, x])
        if qx <= 0.0:
            raise ValueError(f"draft token {x} at position {i} has q = 0: it cannot have been sampled from q")
        r = rng.random()
        if r < min(1.0, px / qx):
            continue
        residual = np.maximum(p[i] - q[i], 0.0)
        if residual.sum() <= 0.0:  # only through rounding when p == q; p itself is then exact
            residual = p[i]
        return i, sample(residual, rng)
    return gamma, (sample(p[gamma], rng) if p[gamma].any() else NO_TOKEN)


def keyed_verify(draft_tokens: Sequence[int], p_of: Callable[[int], np.ndarray], draws: Draws,
                 pos: int) -> tuple[int, int]:
    """Accept while draft i is the target's own keyed draw at its position pos + i, from p_of(i) (the target's
    distribution at verify row i, computed only for the rows reached); then the draw at the first row that differs,
    or at the bonus row after all gamma.

    Every emitted token is the target's draw at its position, so the answer is plain sampling's with the same draws:
    exact (a fresh set of draws per position), and the same text whatever the drafter proposed and however many
    (the drafts only decide how many tokens one pass yields). Drafts sampled with the same draws (Draws.at) match
    wherever q is close to p; Leviathan's rule accepts slightly more of them (sum min(p, q) per token against the
    coupling's chance; docs/benchmarks.md has the figures), so it stays the rule of unseeded requests. An all-zero row
    of p: NO_TOKEN."""
    i = 0
    while True:
        p = p_of(i)
        t = draws.token(p, pos + i) if p.any() else NO_TOKEN
        if i == len(draft_tokens) or t != int(draft_tokens[i]):
            return i, t
        i += 1


def one_hot(tokens: Sequence[int], n_vocab: int) -> np.ndarray:
    """q for deterministic drafters (prompt lookup): all mass on the proposed token."""
    q = np.zeros((len(tokens), n_vocab))
    q[np.arange(len(tokens)), np.asarray(tokens, dtype=np.int64)] = 1.0
    return q
