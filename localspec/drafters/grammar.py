"""The grammar's forced tokens as drafts: where structured output (a JSON schema, a tool call) leaves one way to go
on (a declared key, its quotes and colon, a closing bracket), the constraint says which tokens follow
(llguidance's `compute_ff_tokens`) before the target is asked, and they are proposed like any draft.

The target still verifies them: each verify row is masked by the grammar state after the drafts before it, so a forced
token is accepted wherever the grammar allows only it, at any temperature, and the output is what one-token decoding
under the grammar gives. Free to ask and a function of the grammar state, so the controller judges it by its shadow,
as it does prompt lookup.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from localspec.drafters.base import Drafter, Offer, Proposal
from localspec.sample.sampling import SamplingParams


class GrammarDrafter(Drafter):
    """Proposes the tokens `constraint` forces next (constraint: a request's grammar with `forced(limit)`, whose state
    follows the request's context up to its pending token)."""

    name = "grammar"
    shadowed = True
    prior_alpha = 0.95  # forced tokens: the only ones the grammar allows there

    def __init__(self, constraint) -> None:
        self.constraint = constraint
        self._asked: tuple | None = None  # ((context length, pending token), limit, forced tokens): the last walk

    def offer(self, context: Sequence[int], k: int) -> Offer | None:
        n = len(self._forced(context, k))
        return Offer(n, self.name) if n else None

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator) -> Proposal:
        return Proposal(self._forced(context, k))

    def _forced(self, context: Sequence[int], k: int) -> list[int]:
        """The constraint's forced tokens, at most k. A step asks twice at one grammar state (offer, then propose):
        the matcher walks once; the first k forced tokens are a prefix of any longer walk's."""
        if k <= 0:
            return []
        at = (len(context), context[-1] if context else None)
        if self._asked is not None and self._asked[0] == at and (k <= self._asked[1] or
                                                                 len(self._asked[2]) < self._asked[1]):
            return list(self._asked[2][:k])
        toks = list(self.constraint.forced(k))
        self._asked = (at, k, toks)
        return list(toks)

    def cost(self) -> float:
        return 0.0  # the matcher's walk, next to nothing beside a target step
