"""The requests the replay compares, as Setups (bench/simulate.py): plain decoding, prompt lookup and native
`llama-lookup` at a fixed k, `auto`, and a recorded draft model's proposals (record(..., drafter=...)) at a fixed k or
under `auto`. A request's drafters are assembled as `localspec run` assembles them (core/drafting.py's drafters_for)
from a pool of what the replay has (SimPool): the model-free drafters, the suffix cache over earlier requests, and a
recorded draft model in place of a loaded one.

Native `llama-lookup` is replayed as NativeLookupModel drafts (llama.cpp's n-gram cache, checked against the binary's
own counts on benchmarks/data/native_lookup_traces.json): not prompt lookup at a fixed k, which drafts after matches
the native cache declines and misses the ones it takes after a single token.
"""

from __future__ import annotations

from typing import Sequence

from localspec.bench.simulate import RecordedDrafter, Setup, SimClock
from localspec.core.config import GenConfig
from localspec.core.drafting import drafters_for
from localspec.defaults import SUFFIX_CACHE_TOKENS
from localspec.drafters.base import Drafter
from localspec.drafters.ngram_cache import NgramCacheDrafter, draft_next
from localspec.drafters.prompt_lookup import PromptLookupDrafter
from localspec.drafters.suffix_corpus import Doc, SuffixCorpus
from localspec.drafters.suffix import SuffixDrafter


class NativeLookupModel(NgramCacheDrafter):
    """What native `llama-lookup` drafts (llama.cpp's common/ngram-cache.cpp; no static cache, -lcs): the n-gram cache
    drafter (drafters/ngram_cache.py, the context's own counts), and where those pass at no length, `dynamic` (-lcd:
    the counts of earlier runs' prompts and answers, merged) asked with stricter bounds (2, 2, 3, 4 occurrences; 66,
    66, 66, 75%). Checked against the native binary's own counts (benchmarks/data/native_lookup_traces.json)."""

    name = "native-lookup"
    STRICT = {4: (2, 66), 3: (2, 66), 2: (3, 66), 1: (4, 75)}  # n -> (occurrences, percent) for the dynamic cache's

    def __init__(self, dynamic: dict | None = None) -> None:
        super().__init__()
        self.dynamic = dynamic or {}

    def next_token(self, seq: Sequence[int]) -> tuple[int | None, int]:
        tok, n = super().next_token(seq)
        return (tok, n) if tok is not None else draft_next(self.dynamic, self.STRICT, seq)


class SimPool:
    """What a replayed request's drafters come from (core/drafting.py's DrafterPool), all made afresh for it: prompt
    lookup and the n-gram cache on the request's own text, the suffix drafter over `docs` (earlier requests' prompts and
    answers; None: none, a first request), and `draft` (a recorded draft model) as the draft model. No draft heads;
    structured output is not replayed."""

    def __init__(self, docs: Sequence[Doc] | None = None, draft: Drafter | None = None) -> None:
        self.docs, self.draft = docs, draft

    def lookup_drafter(self, cfg: GenConfig) -> Drafter:
        return PromptLookupDrafter(cfg.lookup_min, cfg.lookup_max)

    def ngram_drafter(self) -> Drafter:
        return NgramCacheDrafter()

    def suffix_drafter(self) -> Drafter:
        corpus = SuffixCorpus(SUFFIX_CACHE_TOKENS, list(self.docs)) if self.docs is not None else None
        return SuffixDrafter(corpus)

    def model_drafter(self, cfg: GenConfig) -> Drafter | None:
        return self.draft

    def head_kinds(self) -> list[str]:
        return []

    def head_drafter(self, kind: str, cfg: GenConfig) -> Drafter:
        raise KeyError(kind)

    def grammar_pays(self) -> bool:
        return False


def assembled(docs: Sequence[Doc] | None = None, draft: str | None = None, draft_cost: float | None = None):
    """Setup.drafters: what drafters_for gives the request's method from a SimPool over `docs`, with the trace's
    recorded proposals of drafter `draft` (if any) as the draft model."""
    def make(cfg: GenConfig, trace: dict | None, clock: SimClock | None) -> dict[str, Drafter]:
        model = recorded(trace, draft, draft_cost, clock, as_name="draft") if draft is not None else None
        return drafters_for(cfg, cfg.method, SimPool(docs, model))

    return make


def plain() -> Setup:
    return Setup("none")


def lookup(k: int) -> Setup:
    return Setup("lookup", k, assembled())


def native_lookup(k: int, dynamic: dict | None = None) -> Setup:
    """Native `llama-lookup` with --spec-draft-n-max k (NativeLookupModel), with `dynamic` its -lcd cache's counts."""
    return Setup("lookup", k, lambda cfg, tr, clock: {"lookup": NativeLookupModel(dynamic)})


def model_free() -> dict[str, Drafter]:
    """The drafters `auto` has on the request's own text, whatever else is loaded."""
    return {"lookup": PromptLookupDrafter(), "ngram": NgramCacheDrafter()}


def auto(curve: dict[int, float], k_max: int = 4, bit_cap: int | None = 2) -> Setup:
    """`auto` up to k_max (exactness auto with the probe's cap `bit_cap`; None: lossless), pricing a verify by
    `curve`, with the drafters of a first request as `localspec run` assembles them without a draft model: prompt
    lookup, the n-gram cache and the suffix drafter (which offers only matches into earlier requests: none yet). The
    draft model is left out: it never pays on a CPU."""
    return Setup("auto", k_max, assembled(), bit_cap, dict(curve))


def cached_drafters(docs: Sequence[Doc]) -> dict[str, Drafter]:
    """The model-free drafters and the suffix cache over `docs`, as `auto` has them with earlier requests cached."""
    return drafters_for(GenConfig(), "auto", SimPool(docs))


def auto_cached(curve: dict[int, float], docs: Sequence[Doc], k_max: int = 4, bit_cap: int | None = 2) -> Setup:
    """`auto` as `localspec run` assembles it with the suffix cache: prompt lookup, the n-gram cache and the suffix
    drafter over `docs` (earlier requests' prompts and answers)."""
    return Setup("auto", k_max, assembled(list(docs)), bit_cap, dict(curve))


def recorded(trace: dict, name: str, draft_cost: float | None = None, clock: SimClock | None = None,
             as_name: str | None = None) -> RecordedDrafter:
    """The trace's recorded proposals of drafter `name` (named `as_name` in the request, default `name`), each token
    costing `draft_cost` target steps (None: the trace's draft_cost) on `clock`."""
    cost = trace.get("draft_cost", 0.0) if draft_cost is None else draft_cost
    return RecordedDrafter(as_name or name, len(trace["prompt"]), trace["proposals"][name], float(cost), clock)


def fixed_recorded(name: str, k: int, draft_cost: float | None = None) -> Setup:
    return Setup("draft", k, assembled(draft=name, draft_cost=draft_cost))


def auto_recorded(name: str, curve: dict[int, float], k_max: int = 4, bit_cap: int | None = 2,
                  draft_cost: float | None = None, chain: bool = True) -> Setup:
    """`auto` with the recorded drafter `name` as its draft model, assembled as `localspec run` does: prompt lookup,
    the n-gram cache, the suffix drafter of a first request, the draft model and, chained with the suffix drafter,
    its proposals extended by the request's own text (drafters/chain.py; a chain pays the draft cost of its model's
    tokens only). Without `chain`: prompt lookup, the n-gram cache and the draft model alone (what `auto` would be
    without the chain)."""
    if chain:
        return Setup("auto", k_max, assembled(draft=name, draft_cost=draft_cost), bit_cap, dict(curve))

    def unchained(cfg: GenConfig, tr: dict, clock: SimClock | None) -> dict[str, Drafter]:
        return {**model_free(), "draft": recorded(tr, name, draft_cost, clock, as_name="draft")}

    return Setup("auto", k_max, unchained, bit_cap, dict(curve))


def recorded_sources(traces: Sequence[dict]) -> list[str]:
    """The drafters whose proposals every trace holds."""
    names = [set(tr.get("proposals") or {}) for tr in traces]
    return sorted(set.intersection(*names)) if names else []
