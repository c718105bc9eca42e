"""How large may a verify batch be while every row's logits stay bit-identical to one-token decoding, and how far
do the rows of bigger batches move?

llama.cpp switches matmul kernels with the batch size (on CPUs that repack Q4_K weights, from 4 rows; on CUDA and
Metal from 2 rows; docs/benchmarks.md, "Exactness: what llama.cpp's kernels do"), so a verify batch can change greedy choices at
small margins. The probe measures, once per model file and build, the largest
exact batch (bit exactness caps k below it) and, per batch size, the largest |logit difference| between a batched
row and the one-token decode of the same position (the divergence audit in `localspec bench` compares a
divergence's top-2 margin with it).

Recurrent/hybrid models (llama/model.py rollback kinds rs/checkpoint) are probed the same way: the state after the
prefix is saved as a checkpoint, so every `truncate` back to it restores it instead of relying on a full-batch
`seq_rm` (which recurrent state cannot do). A probe can be cancelled between decodes (a threading.Event).
"""

from __future__ import annotations

import numpy as np

from localspec.core.probe_memo import (BATCH_KEY, CACHE_FILE, COST_KEY, LONG_CONTEXT, OLD_COST_KEY, is_current, long_ok,
                                       model_key, this_build)
from localspec.store.cachefile import read_json, write_json

PROBE_TEXT = "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n" * 3
PROBE_MIN_UPTO = 9  # the engine probes batches up to at least this (k = 8) once, and derives smaller caps from it


class ProbeCancelled(Exception):
    """The probe's cancel event was set; nothing was cached."""


def check_cancel(cancel) -> None:
    if cancel is not None and cancel.is_set():
        raise ProbeCancelled()


def mark_prefix(model) -> None:
    """The prefix is decoded: a recurrent/hybrid model saves its state here, so truncating back restores it."""
    save = getattr(model, "save_checkpoint", None)
    if save is not None:
        save()


def measure(model, upto: int, cancel=None) -> dict:
    """{"batch": largest B <= upto such that batches of 1..B rows are bit-identical to one-token decodes,
    "deviation": {B: largest |Δlogit| of any row of a B-row batch vs its one-token decode}}, over a short and
    (when the context allows) a long prefix."""
    best, dev = _measure_at(model, upto, 8, cancel)
    if long_ok(model, upto):
        best_long, dev_long = _measure_at(model, upto, LONG_CONTEXT, cancel)
        best = min(best, best_long)
        dev = {b: max(v, dev_long[b]) for b, v in dev.items()}
    return {"batch": best, "deviation": dev}


def probe(model, upto: int) -> int:
    """Largest B <= upto such that batches of 1..B rows are bit-identical to one-token decodes (uncached)."""
    return measure(model, upto)["batch"]


def _measure_at(model, upto: int, prefix: int, cancel=None) -> tuple[int, dict[int, float]]:
    saved = list(model.tokens)
    model.clear()
    try:
        ids = model.tokenize(PROBE_TEXT)
        while len(ids) < prefix + upto + 8:
            ids = ids + ids[1:]
        ctx, seq = ids[:prefix], ids[prefix : prefix + upto]
        model.decode(ctx)
        base = len(model.tokens)
        mark_prefix(model)
        singles = []
        for t in seq:
            check_cancel(cancel)
            singles.append(model.decode([t], "last")[0])
        model.truncate(base)
        best, exact, dev = 1, True, {}
        for b in range(2, len(seq) + 1):
            check_cancel(cancel)
            rows = model.decode(seq[:b], "all")
            model.truncate(base)
            exact = exact and all(np.array_equal(rows[i], singles[i]) for i in range(b))
            if exact:
                best = b
            dev[b] = float(max(np.max(np.abs(rows[i] - singles[i])) for i in range(b)))
        return best, dev
    finally:
        model.clear()
        if saved:
            model.decode(saved, "last")


def _record(model, upto: int, cancel=None) -> dict:
    """The cached measurement for this model, build and settings; measured on a miss (or an entry from an older
    localspec that stored only the batch)."""
    from localspec.llama.sysinfo import llama_cpp_version
    key = model_key(model, upto)
    db = read_json(CACHE_FILE)
    entry = db.get(key)
    if isinstance(entry, dict) and "batch" in entry and isinstance(entry.get("deviation"), dict):
        return entry
    m = measure(model, upto, cancel) if cancel is not None else measure(model, upto)
    entry = {
        "batch": m["batch"],
        "deviation": {str(b): v for b, v in m["deviation"].items()},
        "model": str(model.path.resolve()),
        "upto": upto,
        "threads": model.n_threads,
        "gpu_layers": model.n_gpu_layers,
        "kv_type": model.kv_type,
        "long_prefix": long_ok(model, upto),
        "llama_cpp": llama_cpp_version(),
    }
    db = read_json(CACHE_FILE)  # re-read: another process may have added entries meanwhile
    db[key] = entry
    write_json(CACHE_FILE, db)
    return entry


def max_exact_batch(model, upto: int, cancel=None) -> int:
    """The probe's answer, cached per model file, build, threads, GPU layers and KV type. (LOCALSPEC_ALLOW_INEXACT
    is handled by the engine: it selects lossless exactness.) `cancel`: a threading.Event that stops the probe
    between decodes (ProbeCancelled)."""
    return int(_record(model, upto, cancel)["batch"])


def deviation(model, upto: int) -> dict[int, float]:
    """Per batch size B in 2..upto: the largest |Δlogit| between a row of a B-row batch and the one-token decode
    of the same position (0.0 where bit-identical). Cached with the exact batch."""
    return {int(b): float(v) for b, v in _record(model, upto)["deviation"].items()}


def cached_probes() -> list[dict]:
    """Every cached probe, for `localspec doctor`: model, settings, exact batch and deviation per batch size, and
    whether it is the current file's on this build (`current`)."""
    out, build = [], this_build()
    for key, entry in read_json(CACHE_FILE).items():
        if isinstance(entry, dict) and "batch" in entry and not key.startswith((OLD_COST_KEY, COST_KEY, BATCH_KEY)):
            out.append({**entry, "deviation": {int(b): float(v) for b, v in (entry.get("deviation") or {}).items()},
                        "current": is_current(key, entry, build)})
    return out
