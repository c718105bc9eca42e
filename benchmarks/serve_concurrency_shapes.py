"""Decode time of one 4-slot batched step under the row layouts a step can take (why a step is one pass).

llama.cpp runs a batch over separate KV streams (kv_unified off, as `localspec serve --parallel N`) as passes of
CONSECUTIVE sequences with EQUAL rows each (localspec.llama.multiseq.split_equal): rows [1, 3, 1, 2] cost three
passes (4 x 1, then 1 x 2, then 1 x 1), each reading the weights again. Schemes timed, interleaved, medians:

  uneven    separate streams, rows [1, 3, 1, 2] (3 passes)
  padded    separate streams, every slot padded to 3 rows (1 pass of 12 rows; BatchEngine._pad)
  unified   one unified KV cache, rows [1, 3, 1, 2] (1 pass of 7 rows; LOCALSPEC_KV_UNIFIED=1)
  gap       separate streams, slots 0 and 2 with 2 rows each (2 passes) ...
  adjacent  ... against slots 0 and 1 with 2 rows each (1 pass)
  plain     separate streams, rows [1, 1, 1, 1] (1 pass: no speculation)

usage: python benchmarks/serve_concurrency_shapes.py MODEL.gguf [--reps 20] [--threads 2] [--prompt 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from localspec.llama.model import Model
from localspec.llama.multiseq import MultiSeq


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128, help="tokens in each slot's cache before the step")
    a = ap.parse_args()
    m = Model(a.model, n_ctx=1024, n_threads=a.threads)
    toks = m.tokenize("def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n" * 40, add_special=False)
    prompt = toks[:a.prompt]
    split = MultiSeq(m, 4, n_ctx=1024)
    unified = MultiSeq(m, 4, n_ctx=1024, unified=True)
    for ms in (split, unified):
        for s in range(4):
            ms.decode([(s, prompt, [])])
    nxt = toks[a.prompt:a.prompt + 8]
    schemes = {
        "uneven": (split, [1, 3, 1, 2], [0, 1, 2, 3]),
        "padded": (split, [3, 3, 3, 3], [0, 1, 2, 3]),
        "unified": (unified, [1, 3, 1, 2], [0, 1, 2, 3]),
        "gap": (split, [2, 2], [0, 2]),
        "adjacent": (split, [2, 2], [0, 1]),
        "plain": (split, [1, 1, 1, 1], [0, 1, 2, 3]),
    }
    times: dict[str, list[float]] = {k: [] for k in schemes}
    for name, (ms, rows, seqs) in schemes.items():  # warm-up
        ms.decode([(s, nxt[:r], range(r)) for s, r in zip(seqs, rows)], copy=False)
        for s in seqs:
            ms.truncate(s, len(prompt))
    for _ in range(a.reps):
        for name, (ms, rows, seqs) in schemes.items():
            parts = [(s, nxt[:r], range(r)) for s, r in zip(seqs, rows)]
            t0 = time.perf_counter()
            ms.decode(parts, copy=False)
            times[name].append(time.perf_counter() - t0)
            for s in seqs:
                ms.truncate(s, len(prompt))
    out = {}
    for name, (ms, rows, seqs) in schemes.items():
        passes = len(ms.passes(list(zip(seqs, rows))))
        med = statistics.median(times[name])
        out[name] = {"rows": rows, "slots": seqs, "passes": passes, "median_ms": round(med * 1000, 1),
                     "min_ms": round(min(times[name]) * 1000, 1)}
        print(f"{name:9s} rows {rows!s:14s} slots {seqs!s:14s} passes {passes}  median {med * 1000:7.1f} ms  "
              f"min {min(times[name]) * 1000:7.1f} ms")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
