"""Cost of one target decode of B tokens (logits at every row), relative to B = 1: the verify-cost curve
that decides whether speculation can pay on this machine. Usage: python benchmarks/verify_curve.py MODEL.gguf"""

import statistics
import sys
import time

from localspec.llama.model import Model
def main(path, sizes=(1, 2, 3, 4, 5, 6, 8, 12, 16), reps=5, threads=None):
    m = Model(path, n_ctx=2048, n_threads=threads)
    prompt = m.tokenize("def fibonacci(n):\n    " * 20)
    m.decode(prompt)
    base = len(m.tokens)
    out = {}
    for b in sizes:
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            m.decode(list(range(1000, 1000 + b)), "all")
            ts.append(time.perf_counter() - t)
            m.truncate(base)
        out[b] = statistics.median(ts)
    t1 = out[1]
    for b, t in out.items():
        print(f"B={b:3d}  {t * 1000:7.1f} ms  {t / t1:5.2f}x one token  {t / t1 / b:5.2f}x per token")
    m.close()
    return out


if __name__ == "__main__":
    main(sys.argv[1], threads=int(sys.argv[2]) if len(sys.argv) > 2 else None)
