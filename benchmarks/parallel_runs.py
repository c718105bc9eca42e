"""Four `localspec run`s at once vs the same four one after another (issue: parallel runs fight over the cores).

With the machine-wide generation slot (LOCALSPEC_PARALLEL, default 1) concurrent runs take turns instead of
oversubscribing the cores with llama.cpp's spinning threads. The goal: concurrent wall time <= 1.2x sequential.
Also measured with LOCALSPEC_PARALLEL=4 (the old behaviour: all four generate at once).

Usage: python benchmarks/parallel_runs.py MODEL.gguf [-n 64] [--draft DRAFT.gguf]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

PROMPTS = ["Write a Python function that reverses a string.", "Explain what a hash map is in two sentences.",
           "List three prime numbers and say why they are prime.", "Write a haiku about compilers."]


def cmd(model, draft, n, prompt):
    c = [sys.executable, "-m", "localspec", "run", "-m", model, "-n", str(n), "-q", prompt]
    return c + (["-d", draft] if draft else [])


def sequential(model, draft, n, env):
    t = time.perf_counter()
    for p in PROMPTS:
        subprocess.run(cmd(model, draft, n, p), env=env, check=True, capture_output=True)
    return time.perf_counter() - t


def concurrent(model, draft, n, env):
    t = time.perf_counter()
    procs = [subprocess.Popen(cmd(model, draft, n, p), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for p in PROMPTS]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit("a run failed")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--draft")
    ap.add_argument("-n", type=int, default=64)
    a = ap.parse_args()
    env = {**os.environ, "LOCALSPEC_SUFFIX_CACHE": "0"}  # each run drafts as a first request would (the same prompts again)
    subprocess.run(cmd(a.model, a.draft, 4, "warm up"), env=env, check=True, capture_output=True)  # probe + page cache
    seq = sequential(a.model, a.draft, a.n, env)
    con = concurrent(a.model, a.draft, a.n, {**env, "LOCALSPEC_PARALLEL": "1"})
    old = concurrent(a.model, a.draft, a.n, {**env, "LOCALSPEC_PARALLEL": str(len(PROMPTS))})
    print(f"4 runs of {a.n} tokens: sequential {seq:.1f}s | concurrent with one slot {con:.1f}s ({con / seq:.2f}x) | "
          f"concurrent, no slot (LOCALSPEC_PARALLEL=4) {old:.1f}s ({old / seq:.2f}x)")


if __name__ == "__main__":
    main()
