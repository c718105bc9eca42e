"""Replay the speculation controller on recorded answers, without a model and without timing noise.

    localspec replay TRACES.json [--tokens N] [--curve avx2|avx512|epyc|epyc-steep|flat] [--draft-cost C] [--series]

At temperature 0 the target's answer to a prompt is fixed, so what a drafter proposes at each step and how much of
it the target accepts follow from the recorded tokens alone; a step's cost is T(b)/T(1) from a verify curve (the
calibration `localspec` measures per machine). The request is decoded by the real loop (core/generation.py's
Generation and core/policy.py's policy) over a simulated target and clock, so replaying `auto` and fixed settings over
the same record compares the choices `localspec run` makes, exactly: the same figures every run, where timed runs on
a 2-core machine spread by 5-10%.

The parts: bench/simulate.py (the simulated target and clock, replay()), bench/configs.py (the settings compared),
bench/compare.py (the tables, the series, the best possible), bench/traces.py (recording and reading trace files),
cli/replay.py (the command). This module gathers their names for scripts and tests.
"""

from localspec.bench.compare import alpha, best_possible, leviathan, series, table
from localspec.bench.configs import (NativeLookupModel, auto, auto_cached, auto_recorded, cached_drafters,
                                     fixed_recorded, lookup, model_free, native_lookup, plain, recorded,
                                     recorded_sources)
from localspec.bench.simulate import CURVES, T1, RecordedDrafter, Setup, SimClock, SimTarget, replay, step_cost
from localspec.bench.traces import MAX_BYTES, TraceError, load, record
from localspec.drafters.ngram_cache import count_next
from localspec.drafters.prompt_lookup import PromptLookupDrafter

__all__ = ["CURVES", "MAX_BYTES", "T1", "NativeLookupModel", "PromptLookupDrafter", "RecordedDrafter", "Setup",
           "SimClock", "SimTarget", "TraceError", "alpha", "auto", "auto_cached", "auto_recorded", "best_possible",
           "cached_drafters", "count_next", "fixed_recorded", "leviathan", "load", "lookup", "model_free",
           "native_lookup", "plain", "record", "recorded", "recorded_sources", "replay", "series", "step_cost",
           "table"]
