"""The drafters a request may use, assembled in one place (`drafters_for`) from a pool that holds them: the Engine's
own (core/engine.py: a request alone on the target's context, whose drafters outlive it) or a batch slot's
(core/batch.py: kept in the slot from request to request). A pool answers what each kind is there; which kinds a
method takes, and that `auto` chains every model drafter with the suffix cache, is decided here only."""

from __future__ import annotations

from typing import Protocol

from localspec.drafters import Drafter, chained
from localspec.drafters.grammar import GrammarDrafter


class DrafterPool(Protocol):
    """Where a request's drafters come from."""

    def lookup_drafter(self, cfg) -> Drafter: ...

    def ngram_drafter(self) -> Drafter: ...

    def suffix_drafter(self) -> Drafter: ...

    def model_drafter(self, cfg) -> Drafter | None:
        """The draft model's drafter; None without a draft model whose state rolls back here."""

    def head_kinds(self) -> list[str]:
        """The draft heads loaded (eagle3, dflash, mtp)."""

    def head_drafter(self, kind: str, cfg) -> Drafter: ...

    def grammar_pays(self) -> bool:
        """Whether drafting the tokens structured output forces is worth the verify rows here."""


def drafters_for(cfg, method: str, pool: DrafterPool) -> dict[str, Drafter]:
    """The drafters `method` may use from `pool` (auto: all of them, each model drafter also chained with the
    suffix drafter)."""
    out: dict[str, Drafter] = {}
    if method in ("auto", "lookup"):
        out["lookup"] = pool.lookup_drafter(cfg)
    if method in ("auto", "ngram"):
        out["ngram"] = pool.ngram_drafter()
    if method in ("auto", "suffix"):
        out["suffix"] = pool.suffix_drafter()
        out["suffix"].beside_lookup = "lookup" in out
    if method in ("auto", "draft"):
        d = pool.model_drafter(cfg)
        if d is not None:
            out["draft"] = d
    for kind in pool.head_kinds():  # the draft heads: a method's own, or every one for auto
        if method in ("auto", kind):
            out[kind] = pool.head_drafter(kind, cfg)
    if method == "auto" and hasattr(cfg.constraint, "forced") and pool.grammar_pays():
        out["grammar"] = GrammarDrafter(cfg.constraint)  # the tokens structured output forces
    return chained(out) if method == "auto" else out
