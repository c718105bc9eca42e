"""Prompt-lookup proposer: find the longest suffix n-gram earlier in prompt + output and propose what
followed its most recent occurrence. The n-gram index grows incrementally with the context."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import UsageError
from ..sampling import SamplingParams
from ..seq import common_prefix
from .base import Drafter, Proposal


class PromptLookupDrafter(Drafter):
    name = "lookup"

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
                return toks[e : e + k], n
        return [], 0

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator) -> Proposal:
        if k <= 0:
            return Proposal()
        tokens, _ = self.match(context, k)
        return Proposal(tokens, None)
