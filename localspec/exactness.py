"""How large may a verify batch be while every row's logits stay bit-identical to one-token decoding?

llama.cpp switches matmul kernels with the batch size (measured on Qwen2.5-Coder-1.5B Q4_K_M, AVX-512 CPU:
batches of 1-3 rows are bit-identical to one-token decodes; from 4 rows the repacked Q4_K GEMM kicks in and
logits move by up to 0.65). Verifying with such a batch would change greedy choices at margins below that,
so the engine measures the largest exact batch once per model file and build, and caps k below it.
"""

from __future__ import annotations

import os

import numpy as np

from .cachefile import read_json, write_json

PROBE_TEXT = "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n" * 3


def _key(model, upto: int) -> str:
    st = model.path.stat()
    from .backend import llama_cpp_version

    return "|".join(str(x) for x in (model.path.resolve(), st.st_size, st.st_mtime_ns, model.n_threads, model.n_gpu_layers,
                                     llama_cpp_version(), os.environ.get("LOCALSPEC_NO_REPACK", ""), model.kv_type,
                                     model.n_ctx >= LONG_CONTEXT + upto + 8, upto))


LONG_CONTEXT = 600  # past 512 KV cells, where llama.cpp's CPU attention changes strategy


def probe(model, upto: int) -> int:
    """Largest B <= upto such that batches of 1..B rows are bit-identical to one-token decodes, after a short
    and (when the context allows) a long prefix."""
    best = _probe_at(model, upto, 8)
    if best > 1 and model.n_ctx >= LONG_CONTEXT + upto + 8:
        best = min(best, _probe_at(model, best, LONG_CONTEXT))
    return best


def _probe_at(model, upto: int, prefix: int) -> int:
    saved = list(model.tokens)
    model.clear()
    try:
        ids = model.tokenize(PROBE_TEXT)
        while len(ids) < prefix + upto + 8:
            ids = ids + ids[1:]
        ctx, seq = ids[:prefix], ids[prefix : prefix + upto]
        model.decode(ctx)
        base = len(model.tokens)
        singles = []
        for t in seq:
            singles.append(model.decode([t], "last")[0])
        model.truncate(base)
        best = 1
        for b in range(2, len(seq) + 1):
            rows = model.decode(seq[:b], "all")
            model.truncate(base)
            if not all(np.array_equal(rows[i], singles[i]) for i in range(b)):
                break
            best = b
        return best
    finally:
        model.clear()
        if saved:
            model.decode(saved, "last")


def max_exact_batch(model, upto: int) -> int:
    """The probe's answer, cached per model file, build, threads, GPU layers and KV type. (LOCALSPEC_ALLOW_INEXACT
    is handled by the engine: it selects lossless exactness.)"""
    key = _key(model, upto)
    db = read_json("exact_batch.json")
    if key in db:
        return int(db[key])
    best = probe(model, upto)
    db[key] = best
    write_json("exact_batch.json", db)
    return best
