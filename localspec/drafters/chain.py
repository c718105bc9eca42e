"""A model's proposal extended by the suffix cache: llama.cpp's chained drafting (`--spec-type ngram-mod,mtp`).

A draft model or head stops drafting where it is unsure (p_min) or at k; where it stopped short, the suffix drafter's
confident continuation of the context plus those drafts (this request, earlier requests, earlier sessions, the static
corpus) fills the rest, so one verify checks both. The chain is one more drafter beside its parts: the controller
judges it by its own estimate and picks it only where it measures better than the model alone.

Replayed on recorded Qwen2.5-Coder-1.5B answers with SmolLM2-135M's proposals (docs/benchmarks.md), the chain paid
where a verify of several rows costs about one (a GPU), and neither won nor lost on the 2-core CPU curves.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from localspec.drafters.base import Drafter, Offer, Proposal
from localspec.sample.sampling import SamplingParams


class ChainedDrafter(Drafter):
    """`model`'s proposal, then `tail`'s continuation of it (tail: a drafter with `continuation(context, k)`, the
    suffix drafter). Both parts stay drafters of their own in the policy (their hooks run there, not here)."""

    shadowed = False

    def __init__(self, model: Drafter, tail) -> None:
        self.model = model
        self.tail = tail
        self.name = f"{model.name}+{tail.name}"
        self.prior_alpha = model.prior_alpha
        self.title = f"{getattr(model, 'title', model.name)} + {tail.name}"
        self.n_model = 0  # tokens of the last proposal that the model drafted (the rest are the tail's)

    def offer(self, context: Sequence[int], k: int) -> Offer | None:
        o = self.model.offer(context, k)
        return None if o is None else Offer(o.k, self.name, o.prior)

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator) -> Proposal:
        p = self.model.propose(context, k, sp, rng)
        tokens = list(p.tokens)
        self.n_model = len(tokens)
        more = self.tail.continuation(list(context) + tokens, k - len(tokens)) if len(tokens) < k else []
        if not more:
            return p
        q = p.q
        if q is not None:
            # the continuation is certain as far as the draft goes (one-hot rows, as a proposal without q is read):
            # a token is then accepted with the target's probability of it, and a rejection samples what is left of
            # p (lossless, as for prompt lookup)
            rows = np.zeros((len(more), q.shape[1]), dtype=q.dtype)
            rows[np.arange(len(more)), more] = 1.0
            q = np.concatenate([q, rows]) if len(q) else rows
        return Proposal(tokens + more, q, p.catch_up_s)

    def accept(self, n_drafted: int, n_accepted: int) -> None:
        self.model.accept(self.n_model, min(n_accepted, self.n_model))

    def cost(self) -> float | None:
        return self.model.cost()

    def lag(self, context: Sequence[int]) -> int:
        return self.model.lag(context)

    def close(self) -> None:
        """Nothing of its own: its parts are closed where they were made."""


def chained(drafters: dict[str, Drafter]) -> dict[str, Drafter]:
    """`drafters` and, where the suffix drafter is among them, every model drafter (a draft model, a head) chained
    with it, for the controller to choose from."""
    tail = drafters.get("suffix")
    if tail is None:
        return drafters
    out = dict(drafters)
    for d in drafters.values():
        if not d.shadowed:
            c = ChainedDrafter(d, tail)
            out[c.name] = c
    return out
