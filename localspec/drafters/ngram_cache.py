"""N-gram cache drafter: llama.cpp's lookup cache (common/ngram-cache.cpp, `llama-lookup`, `--spec-type ngram-cache`)
over the prompt and answer so far. For every position it counts which token followed the 1, 2, 3 and 4 tokens before
it; a proposal is the continuation counted most often after the context's longest n-gram whose counts pass a bound
(at least 1, 1, 2, 2 occurrences for n = 4, 3, 2, 1, with a share of 50, 50, 50, 66%), token by token, stopping at
the first token no n-gram supports.

Prompt lookup (prompt_lookup.py) proposes what followed the latest occurrence of the longest 2-4-token match, however
the earlier occurrences went on; this drafter proposes the majority continuation and also drafts after a single token
where its occurrences agree, and stops where they split. Under `auto` both are judged by their shadows every step
and the controller drafts the one whose measured acceptance pays more: on the recorded answers the counts drafted
better where a wrong token is cheap to verify (an AVX-512 curve, on which a 4-row verify costs less than a 3-row one),
prompt lookup where any draft pays (docs/design.md, "Two model-free drafters").
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from localspec.sample.sampling import SamplingParams
from localspec.seq import common_prefix
from localspec.drafters.base import Drafter, Offer, Proposal

N_MAX = 4  # the longest n-gram counted (llama.cpp's LLAMA_NGRAM_MAX)
# n -> (occurrences, percent): the bounds llama.cpp's lookup puts on the context's own counts (ngram_min / p_min)
BOUNDS = {4: (1, 50), 3: (1, 50), 2: (2, 50), 1: (2, 66)}
# n of the n-gram that drafted the first token -> the acceptance its estimate starts from until its shadows are
# judged: under what the recorded answers measured for the first token (0.8-0.89 after 4 tokens, mostly inside copies;
# 0.57-0.68 after 3; 0.31-0.68 after 1 or 2), so a guess is not drafted on a steep verify curve before its shadows
# say it pays (docs/design.md, "Two model-free drafters")
PRIORS = {4: 0.6, 3: 0.5, 2: 0.4, 1: 0.4}

Counts = dict[tuple, dict[int, int]]  # n-gram -> {next token: count}, in the order first seen


def count_next(counts: Counts, tokens: list[int], t: int) -> None:
    """Append t to tokens and count it after each of the 1 to N_MAX tokens before it (llama.cpp's cache update)."""
    tokens.append(t)
    i = len(tokens) - 1
    for n in range(1, N_MAX + 1):
        if i >= n:
            part = counts.setdefault(tuple(tokens[i - n:i]), {})
            part[t] = part.get(t, 0) + 1


def most_counted(part: dict[int, int]) -> tuple[int | None, int, int]:
    """(the token counted most often, its count, all counts); a tie goes to the token first seen latest, as llama.cpp's
    unordered_map (libstdc++) lists its newest keys first."""
    best, top = None, 0
    for tok in reversed(list(part)):
        if part[tok] > top:
            best, top = tok, part[tok]
    return best, top, sum(part.values())


def passes(part: dict[int, int] | None, bound: tuple[int, int]) -> int | None:
    """The most counted token of `part` where its counts pass `bound` (occurrences, percent), else None."""
    if not part:
        return None
    best, top, total = most_counted(part)
    return best if total >= bound[0] and 100 * top >= bound[1] * total else None


def draft_next(counts: Counts, bounds: dict[int, tuple[int, int]], seq: Sequence[int]) -> tuple[int | None, int]:
    """(the token `counts` draft after `seq` from its longest n-gram whose counts pass `bounds`, that n); (None, 0):
    none passes."""
    for n in range(N_MAX, 0, -1):
        if len(seq) >= n:
            tok = passes(counts.get(tuple(seq[-n:])), bounds[n])
            if tok is not None:
                return tok, n
    return None, 0


class NgramCacheDrafter(Drafter):
    name = "ngram"
    shadowed = True

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._counts: Counts = {}

    def begin(self, context: Sequence[int]) -> None:
        if common_prefix(self._tokens, context) < len(self._tokens):  # another conversation: count anew
            self._tokens, self._counts = [], {}
        self._extend(context)

    def _extend(self, context: Sequence[int]) -> None:
        known = len(self._tokens)
        if len(context) < known or (known and context[known - 1] != self._tokens[-1]):  # another context: count anew
            self._tokens, self._counts = [], {}
        for t in context[len(self._tokens):]:
            count_next(self._counts, self._tokens, int(t))

    def next_token(self, seq: Sequence[int]) -> tuple[int | None, int]:
        """(the token the counts draft after `seq`, the n of the n-gram that drafted it); (None, 0): none passes."""
        return draft_next(self._counts, BOUNDS, seq)

    def offer(self, context: Sequence[int], k: int) -> Offer | None:
        """A draft where the counts support a first token, judged by the n-gram that supports it ("ngram@4" ..
        "ngram@1"): a 4-token match is mostly a copy in progress, a 1-token one a guess."""
        if k <= 0:
            return None
        self._extend(context)
        tok, n = self.next_token(self._tokens[-N_MAX:])
        return None if tok is None else Offer(k, f"{self.name}@{n}", PRIORS[n])

    def cost(self) -> float:
        return 0.0  # dictionary reads, next to nothing beside a target step

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator) -> Proposal:
        self._extend(context)
        seq, out = self._tokens[-N_MAX:], []
        while len(out) < k:
            tok, _ = self.next_token(seq)
            if tok is None:
                break
            out.append(tok)
            seq.append(tok)
        return Proposal(out, None)
