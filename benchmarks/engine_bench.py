"""Plain vs draft vs lookup on real models: tokens/s, acceptance, and Python time per step outside llama_decode.

Usage: python benchmarks/engine_bench.py TARGET.gguf [DRAFT.gguf] [-n 128] [--ks 1,2,4]
Also times llama-cpp-python's own high-level generate loop (same library, same threads) as a reference
for the plain decoding rate. Runs are interleaved per prompt; ratios are within one run."""

from __future__ import annotations

import argparse
import statistics
import time

from localspec.core.engine import Engine, GenConfig

PROMPTS = {
    "code": "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "code_edit": "Rename the variable `result` to `config` everywhere in this code and return all of it.\n\n"
                 "def parse_config(path):\n    result = {}\n    with open(path) as fh:\n        for line in fh:\n"
                 "            line = line.strip()\n            if not line or line.startswith('#'):\n                continue\n"
                 "            key, value = line.split('=', 1)\n            result[key.strip()] = value.strip()\n    return result\n",
    "story": "Tell a short story about a robot who learns to paint.",
}


def reference_rate(path: str, prompt: str, n: int, threads: int) -> float:
    import llama_cpp  # reference only: localspec itself imports llama_cpp in backend.py alone

    llm = llama_cpp.Llama(path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, flash_attn=True, verbose=False)
    toks = llm.tokenize(prompt.encode())
    llm.eval(toks)
    t = time.perf_counter()
    produced = 0
    for tok in llm.generate(toks, temp=0.0, reset=True):
        produced += 1
        if produced == 1:
            t = time.perf_counter()  # exclude prompt processing
        if produced >= n:
            break
    rate = (produced - 1) / (time.perf_counter() - t)
    del llm
    return rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("draft", nargs="?")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--ks", default="1,2,4")
    ap.add_argument("--reference", action="store_true", help="also time llama-cpp-python's high-level loop")
    a = ap.parse_args()
    e = Engine.load(a.target, a.draft, n_ctx=2048)
    ks = [int(x) for x in a.ks.split(",")]
    configs = [("none", 0)] + [("lookup", k) for k in ks] + ([("draft", k) for k in ks] if a.draft else [])
    print(f"exact k cap for this model/build: {e.exact_k(max(ks))} (from k={max(ks)})")
    print(f"{'prompt':10} {'config':10} {'tok/s':>7} {'x plain':>8} {'accept':>7} {'len':>5} {'py ms/step':>10} {'same':>5}")
    for name, prompt in PROMPTS.items():
        toks = e.chat_prompt([{"role": "user", "content": prompt}])
        e.complete(toks, GenConfig(method="none", max_tokens=1))
        base = None
        for method, k in configs:
            d0 = e.target.decode_s + (e.draft.decode_s if e.draft else 0.0)
            t0 = time.perf_counter()
            r = e.complete(toks, GenConfig(method=method, k=k, max_tokens=a.n, p_min=0.0 if method == "draft" else 0.75,
                                           adaptive=False))
            wall = time.perf_counter() - t0
            inside = e.target.decode_s + (e.draft.decode_s if e.draft else 0.0) - d0
            s = r.stats
            steps = s.target_passes + 1
            py_ms = (wall - inside) / steps * 1000
            if method == "none":
                base = r
            same = "yes" if r.tokens == base.tokens else "NO"
            print(f"{name:10} {method + ' ' + str(k) if k else method:10} {s.tokens_per_second:7.1f} "
                  f"{s.tokens_per_second / base.stats.tokens_per_second:8.2f} {s.acceptance_rate:7.0%} "
                  f"{s.mean_accepted_length:5.2f} {py_ms:10.2f} {same:>5}")
    if a.reference:
        rates = [reference_rate(a.target, p, a.n, e.target.n_threads) for p in PROMPTS.values()]
        print(f"llama-cpp-python high-level generate (plain, raw prompt): median {statistics.median(rates):.1f} tok/s")
    e.close()


if __name__ == "__main__":
    main()
