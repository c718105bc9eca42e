"""`localspec serve` under 1 and 4 concurrent clients vs `localspec run` on the same prompts.

Starts `localspec serve --port 0` as a subprocess, sends streamed /v1/chat/completions requests (temperature 0, -n
tokens each) from 1 client and then from 4 at once, and reports P50/P95 latency and time to first token as the
client sees them (with 4 clients these include the wait in the queue: one generation runs at a time), the server's
own tokens/s, and the client-side tokens/s next to `localspec run --json` on the same prompts. The HTTP cost is the
client's latency over the engine's elapsed time for the same request (1 client, so no queueing).

Usage: python benchmarks/serve_latency.py [MODEL.gguf] [-d DRAFT.gguf] [-n 64] [--method auto] [--requests 8]
       [--threads N]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

DEFAULT_MODEL = Path.home() / ".cache" / "localspec-test-models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["Write a Python function that reverses a string.", "Explain what a hash map is in two sentences.",
           "List three prime numbers and say why they are prime.", "Write a haiku about compilers."]


# localspec runs without the suffix cache of earlier runs: `run` sends the prompts the server has just answered, and
# a kept cache would draft those answers whole
FIRST = {**os.environ, "LOCALSPEC_SUFFIX_CACHE": "0"}

def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def extra(args):
    return (["-d", args.draft] if args.draft else []) + (["--threads", str(args.threads)] if args.threads else [])


def start_server(args):
    cmd = [sys.executable, "-m", "localspec", "serve", "-m", args.model, "--port", "0", "--method", args.method,
           "--queue", "16"] + extra(args)
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=FIRST)
    for line in p.stderr:
        m = re.match(r"localspec serve: http://([^:]+):(\d+)/v1", line.decode().strip())
        if m:
            threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()  # keep draining
            return p, m.group(1), int(m.group(2))
    raise SystemExit("serve did not start")


def request(host, port, prompt, n):
    """One streamed chat completion: (latency s, ttft s, completion tokens, localspec stats)."""
    body = json.dumps({"model": "localspec", "messages": [{"role": "user", "content": prompt}], "max_tokens": n,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=600)
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    ttft, usage, stats = None, None, None
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        if ev.get("choices") and ev["choices"][0]["delta"].get("content") and ttft is None:
            ttft = time.perf_counter() - t0
        if ev.get("usage"):
            usage, stats = ev["usage"], ev["localspec"]
    lat = time.perf_counter() - t0
    conn.close()
    return lat, ttft or lat, usage["completion_tokens"], stats


def clients(host, port, n_clients, per_client, n):
    results, lock = [], threading.Lock()

    def client(i):
        for j in range(per_client):
            res = request(host, port, PROMPTS[(i + j) % len(PROMPTS)], n)
            with lock:
                results.append(res)

    t0 = time.perf_counter()
    ths = [threading.Thread(target=client, args=(i,)) for i in range(n_clients)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return results, time.perf_counter() - t0


def run_baseline(args):
    out = []
    for p in PROMPTS:
        cmd = [sys.executable, "-m", "localspec", "run", "-m", args.model, "-n", str(args.n), "--method", args.method,
               "--json", "-q", p] + extra(args)
        d = json.loads(subprocess.run(cmd, capture_output=True, check=True, env=FIRST).stdout)
        out.append(d)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=str(DEFAULT_MODEL))
    ap.add_argument("-d", "--draft")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--method", default="auto")
    ap.add_argument("--requests", type=int, default=8, help="requests per scenario")
    ap.add_argument("--threads", type=int, help="passed to both serve and run")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # so the server subprocess is stopped too

    base = run_baseline(args)
    run_tps = statistics.median(d["completion_tokens"] / d["elapsed_s"] for d in base)
    run_gen = statistics.median(d["tokens_per_second"] for d in base if d["tokens_per_second"])
    print(f"localspec run: {len(base)} prompts, median {run_tps:.1f} tok/s end to end "
          f"(generation {run_gen:.1f} tok/s), ttft median {statistics.median(d['ttft_s'] for d in base):.3f}s")

    p, host, port = start_server(args)
    try:
        request(host, port, PROMPTS[0], 8)  # warm-up
        for n_clients in (1, 4):
            res, wall = clients(host, port, n_clients, max(1, args.requests // n_clients), args.n)
            lat = [r[0] for r in res]
            ttft = [r[1] for r in res]
            toks = sum(r[2] for r in res)
            srv_tps = statistics.median(r[3]["tokens_per_second"] for r in res if r[3]["tokens_per_second"])
            engine = [r[3]["elapsed_s"] for r in res]
            line = (f"serve, {n_clients} client(s), {len(res)} requests: latency P50 {pct(lat, 50):.3f}s "
                    f"P95 {pct(lat, 95):.3f}s | ttft P50 {pct(ttft, 50):.3f}s P95 {pct(ttft, 95):.3f}s | "
                    f"throughput {toks / wall:.1f} tok/s | server generation {srv_tps:.1f} tok/s")
            if n_clients == 1:
                client_tps = statistics.median(r[2] / r[0] for r in res)
                overhead = statistics.median((r[0] - e) / r[0] for r, e in zip(res, engine))
                line += (f" | client {client_tps:.1f} tok/s end to end vs run {run_tps:.1f} "
                         f"({client_tps / run_tps - 1:+.1%}) | HTTP + queue cost over engine time {overhead:.1%}")
            print(line, flush=True)
    finally:
        p.terminate()
        p.wait(60)


if __name__ == "__main__":
    main()
