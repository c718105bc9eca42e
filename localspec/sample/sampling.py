"""Turn logits into the distribution we sample from. The same function shapes the target's p and the
draft's q, so speculative sampling reproduces exactly what plain sampling would draw.

Order: temperature, then top-k, top-p, min-p on the tempered distribution, then renormalise.
Temperature 0 means greedy (a one-hot on the argmax; ties go to the lowest id, as numpy's argmax).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from localspec.errors import SettingError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None
    # logit_bias as a vector over the target's vocabulary (bias_vector), for the drafters' rows: the engine sets it
    # on the copy it hands them, so their q is shaped like the biased p (None: no bias)
    bias: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        t = self.temperature
        if t is None or not math.isfinite(t) or t < 0:
            raise SettingError(f"temperature must be a finite number >= 0, got {t}", "temperature")
        if self.top_k < 0:
            raise SettingError(f"top-k ({{top_k}}) must be >= 0, got {self.top_k}", "top_k")
        if not (0.0 < self.top_p <= 1.0) or not math.isfinite(self.top_p):
            raise SettingError(f"top-p ({{top_p}}) must be in (0, 1], got {self.top_p}", "top_p")
        if not (0.0 <= self.min_p < 1.0) or not math.isfinite(self.min_p):
            raise SettingError(f"min-p ({{min_p}}) must be in [0, 1), got {self.min_p}", "min_p")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs(logits: np.ndarray, sp: SamplingParams) -> np.ndarray:
    """Distribution over the vocabulary (float64, sums to 1) for one row of logits. A row that excludes every token
    (-inf everywhere: logit_bias and a grammar leave none) gives all zeros, never NaN: no token can be drawn."""
    x = np.asarray(logits, dtype=np.float64)
    n = x.shape[-1]
    if not n or np.max(x) == -np.inf:
        return np.zeros(n)
    if sp.greedy:
        p = np.zeros(n)
        p[int(np.argmax(x))] = 1.0
        return p
    x = x / sp.temperature
    keep = np.ones(n, dtype=bool)
    if sp.top_k and sp.top_k < n:
        kth = np.partition(x, n - sp.top_k)[n - sp.top_k]
        keep &= x >= kth
    m = np.max(x)
    e = np.exp(x - m)
    e[~keep] = 0.0
    p = e / e.sum()
    if sp.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        c = np.cumsum(p[order])
        # smallest prefix whose mass reaches top_p
        cut = int(np.searchsorted(c, sp.top_p)) + 1
        mask = np.zeros(n, dtype=bool)
        mask[order[:cut]] = True
        p = np.where(mask, p, 0.0)
    if sp.min_p > 0.0:
        p = np.where(p >= sp.min_p * p.max(), p, 0.0)
    return p / p.sum()


class Draws:
    """The random draws of one generation, keyed by position. The token drawn at a position of the sequence is a
    function of the seed, the position and the distribution there only (not of how many draws came before), so a
    drafter's choices and k cannot change a seeded answer: a draft is accepted iff it is the target's own draw at its
    position, and the answer is plain decoding's with the same seed, whatever the method.

    A draw is an exponential race: token argmin_x E[x] / p[x], E iid Exp(1), which is x with probability
    p[x] / sum(p) (the Gumbel-max trick). E comes from a Philox stream keyed by (seed, position), a counter-based
    generator that reaches any position directly. A drafter that samples its q with the same E (at(): draws from a
    position on) proposes the target's token wherever q is close to p (the Gumbel coupling)."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed) % 2**64
        self._key = self.seed << 64  # the Philox key: the seed above, the position below

    def exponentials(self, pos: int, n: int) -> np.ndarray:
        """E at position `pos` for n tokens (the first n of one stream, so a shorter row sees a prefix of them)."""
        gen = np.random.Generator(np.random.Philox(key=self._key | (int(pos) % 2**64)))
        return gen.standard_exponential(n, dtype=np.float32)  # single precision: half the time of double

    def token(self, p: np.ndarray, pos: int) -> int:
        """The draw at position `pos` from p, non-negative weights (token x with probability p[x] / sum(p))."""
        p = np.asarray(p, dtype=np.float64)
        allowed = p > 0
        if not allowed.any():
            raise ValueError("cannot sample from an all-zero distribution")
        race = np.full(len(p), np.inf)
        with np.errstate(over="ignore"):  # a tiny p[x] loses the race (inf)
            np.divide(self.exponentials(pos, len(p)), p, out=race, where=allowed)
        return int(np.argmin(race))

    def at(self, pos: int) -> "Cursor":
        return Cursor(self, pos)


class Cursor:
    """Draws at consecutive positions from `pos` on: a drafter samples its tokens with one (sample(q, cursor)), the
    first at the position after the context, so its draws are the target's at the same positions."""

    def __init__(self, draws: Draws, pos: int) -> None:
        self.draws = draws
        self.pos = pos

    def draw(self, p: np.ndarray) -> int:
        t = self.draws.token(p, self.pos)
        self.pos += 1
        return t


def sample(p: np.ndarray, rng: np.random.Generator | Cursor) -> int:
    """Draw one index from a (possibly unnormalised) non-negative vector: by inverse CDF from a numpy Generator, or
    a Cursor's keyed draw at its next position."""
    if isinstance(rng, Cursor):
        return rng.draw(p)
    c = np.cumsum(p)
    total = c[-1]
    if not total > 0:
        raise ValueError("cannot sample from an all-zero distribution")
    i = int(np.searchsorted(c, rng.random() * total, side="right"))
    return min(i, len(p) - 1)


def biased(row: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """row + bias over the ids both cover (a drafter's row may be shorter or longer than the target's vocabulary)."""
    if bias is None:
        return row
    n = min(len(row), len(bias))
    out = np.array(row, dtype=np.float32, copy=True)
    out[:n] += bias[:n]
    return out


def bias_vector(logit_bias: dict[int, float] | None, n_vocab: int) -> np.ndarray | None:
    """logit_bias as a vector to add to a row of logits (None: no bias). A bias <= -100 bans the token (-inf), as
    OpenAI's "-100 should result in a ban"; ids outside the vocabulary are ignored (the server checks them)."""
    if not logit_bias:
        return None
    v = np.zeros(n_vocab, dtype=np.float32)
    for t, b in logit_bias.items():
        if 0 <= int(t) < n_vocab:
            v[int(t)] = -np.inf if b <= -100 else b
    return v


# the lowest logprob reported (OpenAI's own floor): JSON has no -Infinity or NaN, so a logprob that is not a finite
# number (a token the row excludes) is written as this
LOGPROB_FLOOR = -9999.0


def token_logprobs(row: np.ndarray, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """(logprob of `token`, the n most likely (token, logprob), best first, ties by id) under log-softmax of the
    raw row (temperature 1, as OpenAI reports them; the row is already biased and grammar-masked). Tokens the
    row excludes (-inf) are never among the top ones; every number is finite (LOGPROB_FLOOR at the least)."""
    x = np.asarray(row, dtype=np.float64)
    m = float(np.max(x))
    if not math.isfinite(m):  # the row excludes every token
        return LOGPROB_FLOOR, []
    lse = m + float(np.log(np.sum(np.exp(x - m))))
    top: list[tuple[int, float]] = []
    if n > 0:
        n = min(n, x.shape[-1])
        idx = np.argpartition(-x, n - 1)[:n]
        idx = idx[np.lexsort((idx, -x[idx]))]
        top = [(int(i), float(x[i] - lse)) for i in idx if np.isfinite(x[i])]
    lp = float(x[int(token)] - lse)
    return (lp if math.isfinite(lp) else LOGPROB_FLOOR), top
