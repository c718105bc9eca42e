"""Prompt-lookup proposer: find the longest suffix n-gram earlier in prompt + output and propose what
followed its most recent occurrence. The n-gram index grows incrementally with the context."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from localspec.errors import UsageError
from localspec.sample.sampling import SamplingParams
from localspec.seq import common_prefix
from localspec.drafters.base import Drafter, Offer, Proposal


REACH_MAX = 12  # a match's reach is counted up to here (the top band)
# reach -> the estimate that judges it, and the acceptance that estimate starts from until measured: a longer match is
# a copy in progress, accepted more often. The middle priors sit below what the replay measures for their bands: a
# short copy's first steps, judged on the measured figure, were drafted at a loss before its first miss was seen. A
# copy that has run for 6 tokens is judged apart from 4-5-token matches: judged with them, the copies inside an answer
# were declined after a few failed shorter matches (docs/benchmarks.md, "By the reach of its match").
REACH_BANDS = ((0, 3, "2-3", 0.5), (4, 5, "4-5", 0.6), (6, 11, "6-11", 0.75), (12, REACH_MAX, "12+", 0.9))


class PromptLookupDrafter(Drafter):
    name = "lookup"
    shadowed = True

    def __init__(self, lookup_min: int = 2, lookup_max: int = 4) -> None:
        if lookup_min < 1 or lookup_max < lookup_min:
            raise UsageError(f"need 1 <= lookup-min <= lookup-max, got {lookup_min} and {lookup_max}")
        self.n_min = lookup_min
        self.n_max = lookup_max
        self._tokens: list[int] = []
        # n -> {ngram tuple: end index e of its most recent occurrence with a continuation (tokens[e] exists)}
        self._index: dict[int, dict[tuple, int]] = {n: {} for n in range(lookup_min, lookup_max + 1)}

    def begin(self, context: Sequence[int]) -> None:
        if common_prefix(self._tokens, context) < len(self._tokens):  # context diverged (new conversation): rebuild
            self._tokens = []
            self._index = {n: {} for n in self._index}
        self._extend(context)

    def _extend(self, context: Sequence[int]) -> None:
        toks = self._tokens
        for t in context[len(toks):]:
            toks.append(int(t))
            e = len(toks) - 1  # the gram ending just before the new token now has a continuation
            for n, idx in self._index.items():
                if e >= n:
                    idx[tuple(toks[e - n : e])] = e

    def match(self, context: Sequence[int], k: int) -> tuple[list[int], int]:
        """(proposed tokens, n-gram size matched); ([], 0) when nothing matches."""
        tokens, n, _ = self._match(context, k)
        return tokens, n

    def _match(self, context: Sequence[int], k: int) -> tuple[list[int], int, int]:
        """(proposed tokens, n-gram size matched, end of the earlier occurrence); ([], 0, 0) without a match."""
        known = len(self._tokens)
        if len(context) < known or (known and context[known - 1] != self._tokens[-1]):
            self.begin(context)  # not a continuation of what we indexed (cheap check: the last token)
        else:
            self._extend(context)
        toks = self._tokens
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(toks) < n:
                continue
            e = self._index[n].get(tuple(toks[-n:]))
            if e is not None:
                return toks[e : e + k], n, e
        return [], 0, 0

    def reach(self, e: int) -> int:
        """How far back the context's end agrees with the text before position e (the earlier occurrence), up to
        REACH_MAX tokens: beyond the matched n-gram, this is how long the copy has been running."""
        toks, n = self._tokens, 0
        while n < REACH_MAX and e - 1 - n >= 0 and toks[-1 - n] == toks[e - 1 - n]:
            n += 1
        return n

    def offer(self, context: Sequence[int], k: int) -> Offer | None:
        """The match this step would propose, judged by how far back it reaches: a match that agrees with the
        12 tokens before it is a copy in progress, accepted far more often than a 2-token match in prose. Keys:
        "lookup@2-3", "lookup@4-5", "lookup@6-11", "lookup@12+" (measured on the recorded Qwen answers,
        `bench.replay`: the next token was accepted 0.5-0.65 of the time at a reach of 2-3 tokens, 0.67-0.79 at 4-5,
        0.84-0.92 at 6-11 and 0.95 at 12 or more)."""
        tokens, n, e = self._match(context, k)
        if not tokens:
            return None
        reach = self.reach(e)
        band, prior = next((b, p) for lo, hi, b, p in REACH_BANDS if lo <= reach <= hi)  # reach <= REACH_MAX
        return Offer(len(tokens), f"{self.name}@{band}", prior)

    def cost(self) -> float:
        return 0.0  # a dictionary lookup, next to nothing beside a target step

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator) -> Proposal:
        if k <= 0:
            return Proposal()
        tokens, _ = self.match(context, k)
        return Proposal(tokens, None)
