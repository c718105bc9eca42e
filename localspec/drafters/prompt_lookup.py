"""Prompt-lookup proposer: find the longest suffix n-gram earlier in prompt + output and propose what
followed its most recent occurrence. The n-gram index grows incrementally with the context."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from localspec.errors import UsageError
from localspec.core.sampling import SamplingParams
from localspec.seq import common_prefix
from localspec.drafters.base import Drafter, Offer, Proposal


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

    def offer(self, context: Sequence[int], k: int) -> Offer | None:
        """The match this step would propose: its length, judged per matched n-gram size ("lookup@4": a 4-token
        match inside code being copied is accepted far more often than a 2-token match in prose)."""
        tokens, n = self.match(context, k)
        return Offer(len(tokens), f"{self.name}@{n}") if tokens else None

    def cost(self) -> float:
        return 0.0  # a dictionary lookup, next to nothing beside a target step

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator) -> Proposal:
        if k <= 0:
            return Proposal()
        tokens, _ = self.match(context, k)
        return Proposal(tokens, None)
