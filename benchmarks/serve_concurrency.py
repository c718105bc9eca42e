"""Load test: N clients at once against a running OpenAI-compatible server: aggregate tokens/s, median/P95 latency.

Works against `localspec serve` and native `llama-server` alike (both speak POST /v1/chat/completions and report
`usage.completion_tokens`). Each client sends --requests non-streamed chat requests one after another (temperature
0, -n tokens), all clients starting together; a phase's aggregate tok/s is every completion token of the phase over
its wall time, latency is each request's send-to-answer time as the client sees it (queueing included).

Usage: python benchmarks/serve_concurrency.py --url http://127.0.0.1:8080 [--clients 1,2,4] [-n 64]
       [--requests 2] [--label NAME] [--localspec-method auto] [--json-schema] [--json]

E.g. (same model, same machine, one server at a time):
  localspec serve -m qwen2.5-coder-1.5b-instruct.gguf --method none --parallel 4 --port 8080 &
  python benchmarks/serve_concurrency.py --url http://127.0.0.1:8080 --label "localspec -np 4 plain"
  llama-server -m qwen2.5-coder-1.5b-instruct.gguf -np 4 -c 16384 -fa on --port 8081 &
  python benchmarks/serve_concurrency.py --url http://127.0.0.1:8081 --label "llama-server -np 4"
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from urllib.parse import urlparse

PROMPTS = ["Write a Python function that reverses a string.", "Explain what a hash map is in two sentences.",
           "List three prime numbers and say why they are prime.", "Write a haiku about compilers.",
           "Write a Python function that checks whether a number is prime.", "What does `git rebase` do?",
           "Write a SQL query that counts users per country.", "Explain Python decorators briefly."]


SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "points": {"type": "array", "items": {
    "type": "string"}, "maxItems": 5}, "confidence": {"type": "number"}}, "required": ["title", "points", "confidence"],
          "additionalProperties": False}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def request(url, body: dict, timeout: float) -> tuple[float, int, str]:
    """(latency s, completion tokens, text) of one chat request."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    dt = time.perf_counter() - t0
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")
    d = json.loads(data)
    return dt, int(d["usage"]["completion_tokens"]), d["choices"][0]["message"]["content"]


def body_for(i: int, args) -> dict:
    b = {"model": "x", "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
         "max_tokens": args.n, "temperature": 0}
    if args.localspec_method:
        b["localspec"] = {"method": args.localspec_method}
    if args.json_schema:  # structured output on every request (what agents send)
        b["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    return b


def phase(args, clients: int) -> dict:
    lat, toks, errors = [], [], []
    go = threading.Barrier(clients)
    lock = threading.Lock()

    def client(c: int) -> None:
        go.wait()
        for j in range(args.requests):
            try:
                dt, n, _ = request(args.url, body_for(c * args.requests + j, args), args.timeout)
            except Exception as exc:  # counted, shown, not fatal
                with lock:
                    errors.append(str(exc))
                continue
            with lock:
                lat.append(dt)
                toks.append(n)

    ths = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    wall = time.perf_counter() - t0
    return {"clients": clients, "requests": len(lat), "errors": len(errors), "first_error": errors[0] if errors else None,
            "wall_s": round(wall, 3), "completion_tokens": sum(toks),
            "aggregate_tok_s": round(sum(toks) / wall, 2) if wall > 0 else 0.0,
            "median_latency_s": round(statistics.median(lat), 3) if lat else None,
            "p95_latency_s": round(pct(lat, 95), 3) if lat else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8080")
    ap.add_argument("--clients", default="1,2,4", help="comma-separated client counts, one phase each")
    ap.add_argument("-n", type=int, default=64, help="max_tokens per request")
    ap.add_argument("--requests", type=int, default=2, help="requests each client sends, one after another")
    ap.add_argument("--label", default="", help="a name for this server in the output")
    ap.add_argument("--localspec-method", default=None, help="send localspec.method (localspec serve only)")
    ap.add_argument("--json-schema", action="store_true", help="every request asks for a json_schema answer")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args(argv)
    try:
        counts = [int(x) for x in args.clients.split(",") if x.strip()]
    except ValueError:
        print(f"error: --clients must be whole numbers, got {args.clients!r}", file=sys.stderr)
        return 2
    if not counts or min(counts) < 1 or args.n < 1 or args.requests < 1:
        print("error: --clients, -n and --requests must be >= 1", file=sys.stderr)
        return 2
    try:
        if not args.no_warmup:
            request(args.url, body_for(0, args), args.timeout)
    except Exception as exc:
        print(f"error: {args.url}: {exc}", file=sys.stderr)
        return 1
    rows = [phase(args, c) for c in counts]
    if args.json:
        print(json.dumps({"label": args.label, "url": args.url, "max_tokens": args.n, "phases": rows}))
        return 0
    print(f"{args.label or args.url} (max_tokens {args.n}, {args.requests} requests per client)")
    print("| clients | aggregate tok/s | median latency s | P95 latency s | requests | errors |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['aggregate_tok_s']} | {r['median_latency_s']} | {r['p95_latency_s']} | "
              f"{r['requests']} | {r['errors']} |")
    for r in rows:
        if r["first_error"]:
            print(f"first error with {r['clients']} clients: {r['first_error']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
