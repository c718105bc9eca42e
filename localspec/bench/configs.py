"""The requests the replay compares, as Setups (bench/simulate.py): plain decoding, prompt lookup and native
`llama-lookup` at a fixed k, `auto` with the drafters `localspec run` gives it, and a recorded draft model's proposals
(record(..., drafter=...)) at a fixed k or under `auto`.

Native `llama-lookup` is replayed as NativeLookupModel drafts (llama.cpp's n-gram cache, checked against the binary's
own counts on benchmarks/data/native_lookup_traces.json): not prompt lookup at a fixed k, which drafts after matches
the native cache declines and misses the ones it takes after a single token.
"""

from __future__ import annotations

from typing import Sequence

from localspec.bench.simulate import RecordedDrafter, Setup, SimClock
from localspec.defaults import SUFFIX_CACHE_TOKENS
from localspec.drafters.base import Drafter
from localspec.drafters.chain import chained
from localspec.drafters.ngram_cache import NgramCacheDrafter, draft_next
from localspec.drafters.prompt_lookup import PromptLookupDrafter
from localspec.drafters.suffix import Doc, SuffixCorpus, SuffixDrafter


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


def plain() -> Setup:
    return Setup("none")


def lookup(k: int) -> Setup:
    return Setup("lookup", k, lambda tr, clock: {"lookup": PromptLookupDrafter()})


def native_lookup(k: int, dynamic: dict | None = None) -> Setup:
    """Native `llama-lookup` with --spec-draft-n-max k (NativeLookupModel), with `dynamic` its -lcd cache's counts."""
    return Setup("lookup", k, lambda tr, clock: {"lookup": NativeLookupModel(dynamic)})


def model_free() -> dict[str, Drafter]:
    """The drafters `auto` has on the request's own text, whatever else is loaded."""
    return {"lookup": PromptLookupDrafter(), "ngram": NgramCacheDrafter()}


def auto(curve: dict[int, float], k_max: int = 4, bit_cap: int | None = 2) -> Setup:
    """`auto` up to k_max (exactness auto with the probe's cap `bit_cap`; None: lossless), pricing a verify by
    `curve`, with the model-free drafters of a first request as `localspec run` builds it: prompt lookup and the
    n-gram cache (its suffix drafter offers only matches into earlier requests, and there are none yet; the draft
    model left out: it never pays on a CPU)."""
    return Setup("auto", k_max, lambda tr, clock: model_free(), bit_cap, dict(curve))


def cached_drafters(docs: Sequence[Doc]) -> dict[str, Drafter]:
    """The model-free drafters and the suffix cache over `docs`, as `auto` has them with earlier requests cached."""
    return {**model_free(), "suffix": SuffixDrafter(SuffixCorpus(SUFFIX_CACHE_TOKENS, list(docs)), beside_lookup=True)}


def auto_cached(curve: dict[int, float], docs: Sequence[Doc], k_max: int = 4, bit_cap: int | None = 2) -> Setup:
    """`auto` as `localspec run` builds it with the suffix cache: prompt lookup, the n-gram cache and the suffix
    drafter over `docs` (earlier requests' prompts and answers)."""
    return Setup("auto", k_max, lambda tr, clock: cached_drafters(docs), bit_cap, dict(curve))


def recorded(trace: dict, name: str, draft_cost: float | None = None, clock: SimClock | None = None) -> RecordedDrafter:
    """The trace's recorded proposals of drafter `name`, each token costing `draft_cost` target steps (None: the
    trace's draft_cost) on `clock`."""
    cost = trace.get("draft_cost", 0.0) if draft_cost is None else draft_cost
    return RecordedDrafter(name, len(trace["prompt"]), trace["proposals"][name], float(cost), clock)


def fixed_recorded(name: str, k: int, draft_cost: float | None = None) -> Setup:
    return Setup("draft", k, lambda tr, clock: {"draft": recorded(tr, name, draft_cost, clock)})


def auto_recorded(name: str, curve: dict[int, float], k_max: int = 4, bit_cap: int | None = 2,
                  draft_cost: float | None = None, chain: bool = True) -> Setup:
    """`auto` choosing each step among prompt lookup, the n-gram cache, the recorded drafter `name` and, with
    `chain`, that drafter's proposals extended by the request's own text (drafters/chain.py; the suffix cache of a
    first request). A chain pays the draft cost of its model's tokens only."""
    def drafters(tr: dict, clock: SimClock | None) -> dict[str, Drafter]:
        out = {**model_free(), name: recorded(tr, name, draft_cost, clock)}
        return chained({**out, "suffix": SuffixDrafter(None, beside_lookup=True)}) if chain else out

    return Setup("auto", k_max, drafters, bit_cap, dict(curve))


def recorded_sources(traces: Sequence[dict]) -> list[str]:
    """The drafters whose proposals every trace holds."""
    names = [set(tr.get("proposals") or {}) for tr in traces]
    return sorted(set.intersection(*names)) if names else []
