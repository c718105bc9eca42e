"""How large may a verify batch be while every row's logits stay bit-identical to one-token decoding, and how far
do the rows of bigger batches move?

llama.cpp switches matmul kernels with the batch size (measured on Qwen2.5-Coder-1.5B Q4_K_M, AVX-512 CPU:
batches of 1-3 rows are bit-identical to one-token decodes; from 4 rows the repacked Q4_K GEMM kicks in and
logits move by up to 0.65; on CUDA and Metal the kernels change from 2 rows on). Verifying with such a batch
can change greedy choices at margins below that. The probe measures, once per model file and build, the largest
exact batch (bit exactness caps k below it) and, per batch size, the largest |logit difference| between a batched
row and the one-token decode of the same position (the divergence audit in `localspec bench` compares a
divergence's top-2 margin with it).

Recurrent/hybrid models (llama/model.py rollback kinds rs/checkpoint) are probed the same way: the state after the
prefix is saved as a checkpoint, so every `truncate` back to it restores it instead of relying on a full-batch
`seq_rm` (which recurrent state cannot do). A probe can be cancelled between decodes (a threading.Event).
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from localspec.store.cachefile import read_json, update_json, write_json

PROBE_TEXT = "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n" * 3
LONG_CONTEXT = 600  # past 512 KV cells, where llama.cpp's CPU attention changes strategy
CACHE_FILE = "exact_batch.json"
PROBE_MIN_UPTO = 9  # the engine probes batches up to at least this (k = 8) once, and derives smaller caps from it


class ProbeCancelled(Exception):
    """The probe's cancel event was set; nothing was cached."""


def _check(cancel) -> None:
    if cancel is not None and cancel.is_set():
        raise ProbeCancelled()


def _mark(model) -> None:
    """The prefix is decoded: a recurrent/hybrid model saves its state here, so truncating back restores it."""
    save = getattr(model, "save_checkpoint", None)
    if save is not None:
        save()


def _long_ok(model, upto: int) -> bool:
    return model.n_ctx >= LONG_CONTEXT + upto + 8


def _build() -> str:
    """The llama.cpp build and the CPU it runs on: its version, what it was compiled with (llama_print_system_info's
    features and backends) and the CPU's features. A rebuild with other CMAKE_ARGS (AVX-512 off, CUDA on) keeps the
    version, and a cache dir shared between machines (a network home) keeps the file, but either changes the
    kernels, and so what the probes measure. (Not the devices' list: asking an RPC device is a network call.)"""
    import hashlib

    from localspec.llama.sysinfo import cpu_flags, llama_cpp_version, system_info
    what = [system_info(), *sorted(cpu_flags())]
    return f"{llama_cpp_version()}+{hashlib.sha256(chr(10).join(what).encode()).hexdigest()[:12]}"


def _key(model, upto: int) -> str:
    st = model.path.stat()
    parts = [model.path.resolve(), st.st_size, st.st_mtime_ns, model.n_threads, model.n_gpu_layers,
             _build(), os.environ.get("LOCALSPEC_NO_REPACK", ""), model.kv_type,
             _long_ok(model, upto), upto]
    if getattr(model, "rpc_servers", None):  # the workers compute the layers: their kernels decide
        parts += ["rpc=" + ",".join(model.rpc_servers), "split=" + str(getattr(model, "tensor_split", None))]
    return "|".join(str(x) for x in parts)


def measure(model, upto: int, cancel=None) -> dict:
    """{"batch": largest B <= upto such that batches of 1..B rows are bit-identical to one-token decodes,
    "deviation": {B: largest |Δlogit| of any row of a B-row batch vs its one-token decode}}, over a short and
    (when the context allows) a long prefix."""
    best, dev = _measure_at(model, upto, 8, cancel)
    if _long_ok(model, upto):
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
        _mark(model)
        singles = []
        for t in seq:
            _check(cancel)
            singles.append(model.decode([t], "last")[0])
        model.truncate(base)
        best, exact, dev = 1, True, {}
        for b in range(2, len(seq) + 1):
            _check(cancel)
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
    key = _key(model, upto)
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
        "long_prefix": _long_ok(model, upto),
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
    """Every cached probe, for `localspec doctor`: model, settings, exact batch and deviation per batch size."""
    out = []
    for key, entry in read_json(CACHE_FILE).items():
        if isinstance(entry, dict) and "batch" in entry and not key.startswith(("cost|", COST_KEY, BATCH_KEY)):
            out.append({**entry, "deviation": {int(b): float(v) for b, v in (entry.get("deviation") or {}).items()}})
    return out


# ------------------------------------------------------------------ what a verify batch costs here
COST_MIN_UPTO = 9  # measured at least up to this batch (k = 8), so most k changes need no new measurement
COST_REPS = 5
COST_KEY = "cost2|"  # cost|: timed one size after the other (time_batches' docstring), measured again


def time_batches(model, upto: int, reps: int = COST_REPS, cancel=None) -> dict[int, float]:
    """Seconds per decode of b rows (all logits, as a verify pass) for b in 1..upto, the median of `reps` timed
    decodes after a 64-token prefix; the model's cache is restored afterwards. Also bench's same-run curve.

    The sizes are timed in interleaved sweeps (1..upto, then upto..1, ...) after one untimed sweep, so a machine
    that slows down or speeds up while it measures shifts every size alike. Timed one size after the other (three
    decodes of 1 row, then three of 2, ...), a busy first second on a 2-core AMD EPYC made 5-9 rows look 10-30%
    cheaper than they are, the calibration kept that for good, and auto drafted where it lost (write code 0.92x)."""
    saved = list(model.tokens)
    model.clear()
    try:
        ids = model.tokenize(PROBE_TEXT)
        while len(ids) < 64 + upto:
            ids = ids + ids[1:]
        model.decode(ids[:64])
        base = len(model.tokens)
        _mark(model)
        sizes = list(range(1, upto + 1))
        ts: dict[int, list[float]] = {b: [] for b in sizes}
        for sweep in range(reps + 1):
            for b in sizes if sweep % 2 == 0 else sizes[::-1]:
                _check(cancel)
                t0 = time.perf_counter()
                model.decode(ids[64 : 64 + b], "all")
                dt = time.perf_counter() - t0
                model.truncate(base)
                if sweep:  # the first sweep warms the kernels and buffers up for every size
                    ts[b].append(dt)
        return {b: statistics.median(v) for b, v in ts.items()}
    finally:
        model.clear()
        if saved:
            model.decode(saved, "last")


def _measure_costs(model, upto: int) -> dict[int, float]:
    """T(b) / T(1) for b in 1..upto."""
    t = time_batches(model, upto)
    return {b: v / t[1] for b, v in t.items()}


def verify_costs(model, upto: int) -> dict[int, float]:
    """What a verify batch of b rows costs in one-token decodes, for b in 1..max(upto, COST_MIN_UPTO), measured once
    per model file, build, threads, GPU layers and KV type (cached beside the probe). The adaptive controller
    starts from it instead of a guessed slope: on a 2-core AVX-512 CPU a batch of 4 rows costs less than one of 3
    (the repacked GEMM), on a GPU 9 rows cost about one."""
    upto = max(upto, COST_MIN_UPTO)
    key = COST_KEY + _key(model, 0)
    entry = read_json(CACHE_FILE).get(key)
    if isinstance(entry, dict) and isinstance(entry.get("ratio"), dict) and len(entry["ratio"]) >= upto:
        return {int(b): float(v) for b, v in entry["ratio"].items()}
    ratio = _measure_costs(model, upto)
    db = read_json(CACHE_FILE)
    db[key] = {"ratio": {str(b): v for b, v in ratio.items()}, "model": str(model.path.resolve()),
               "threads": model.n_threads, "gpu_layers": model.n_gpu_layers}
    write_json(CACHE_FILE, db)
    return ratio


def verify_costs_cached(model, upto: int) -> bool:
    """Whether verify_costs(model, upto) is answered from the cache (no measuring)."""
    entry = read_json(CACHE_FILE).get(COST_KEY + _key(model, 0))
    return isinstance(entry, dict) and isinstance(entry.get("ratio"), dict) and \
        len(entry["ratio"]) >= max(upto, COST_MIN_UPTO)


def cached_costs() -> list[dict]:
    """Every cached verify-cost calibration, for `localspec doctor`: model, threads, GPU layers, T(b)/T(1) per b."""
    out = []
    for key, entry in read_json(CACHE_FILE).items():
        if key.startswith(COST_KEY) and isinstance(entry, dict) and isinstance(entry.get("ratio"), dict):
            out.append({"model": entry.get("model"), "threads": entry.get("threads"), "gpu_layers": entry.get("gpu_layers"),
                        "ratio": {int(b): float(v) for b, v in entry["ratio"].items()}})
    return out


# ------------------------------------------------------------------ the batch exactness probe's verdicts
BATCH_KEY = "batch|"  # core/batch.py's probe of several requests in one pass, beside the single-sequence probes


def batch_probe_key(model, *settings) -> str:
    """The cache key of a batch probe: the model file, the llama.cpp build and the model's settings (as the
    single-sequence probe's key), and the batch's own settings that decide the verdict (slots, rows, layout)."""
    return BATCH_KEY + _key(model, 0) + "|" + "|".join(str(x) for x in settings)


def cached_batch_probe(key: str) -> dict | None:
    entry = read_json(CACHE_FILE).get(key)
    return entry if isinstance(entry, dict) and isinstance(entry.get("exact"), bool) else None


def store_batch_probe(key: str, entry: dict) -> None:
    """Add one verdict (under the memo's lock: another process's entries are kept)."""
    update_json(CACHE_FILE, lambda db: db.__setitem__(key, entry))
