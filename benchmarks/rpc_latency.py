"""Speculation over the network: plain vs `auto` with the target local, on one RPC worker and on two, at several
added round-trip times (a TCP proxy in front of each worker delays every chunk by RTT/2 in each direction).

Usage: python benchmarks/rpc_latency.py TARGET.gguf [DRAFT.gguf] [-n 64] [--rtt 0,2,10] [--prompts 2]
       python benchmarks/rpc_latency.py proxy --listen PORT --to HOST:PORT --delay-ms D   (the proxy alone)

Everything runs on this machine: the workers are `localspec worker` processes on 127.0.0.1 and compete for the
same cores as the client (a verify pass cannot overlap with a worker's compute anyway: the layers run one
device after another), all with OMP_WAIT_POLICY=PASSIVE. RTT 0 connects to the workers directly, without the
proxy. Tokens/s excludes the prompt; "same tokens" compares every output with the local plain run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ the delaying proxy
async def _pipe(reader, writer, delay: float) -> None:
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()

    async def read():
        try:
            while True:
                data = await reader.read(1 << 20)
                if not data:
                    break
                q.put_nowait((loop.time() + delay, data))
        except OSError:
            pass
        q.put_nowait((0.0, b""))

    async def write():
        try:
            while True:
                due, data = await q.get()
                if not data:
                    break
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    await asyncio.gather(read(), write())


async def _proxy(listen: int, host: str, port: int, delay: float) -> None:
    async def handle(cr, cw):
        try:
            ur, uw = await asyncio.open_connection(host, port)
        except OSError:
            cw.close()
            return
        for w in (cw, uw):
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(_pipe(cr, uw, delay), _pipe(ur, cw, delay))

    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    print("proxy ready", flush=True)
    async with server:
        await server.serve_forever()


def proxy_main(argv) -> None:
    ap = argparse.ArgumentParser(prog="rpc_latency.py proxy")
    ap.add_argument("--listen", type=int, required=True)
    ap.add_argument("--to", required=True)
    ap.add_argument("--delay-ms", type=float, required=True, help="added per direction")
    a = ap.parse_args(argv)
    host, port = a.to.rsplit(":", 1)
    try:
        asyncio.run(_proxy(a.listen, host, int(port), a.delay_ms / 1000))
    except KeyboardInterrupt:
        pass


# ------------------------------------------------------------------ processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd, ready: str, env=None) -> subprocess.Popen:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line and p.poll() is not None:
            raise RuntimeError(f"{cmd} exited with {p.returncode}")
        if ready in line:
            # keep draining its output so it never blocks on a full pipe
            import threading

            threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
            return p
    p.kill()
    raise RuntimeError(f"{cmd}: no {ready!r} within 60 s")


def start_worker(port: int, threads: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return _start([sys.executable, "-m", "localspec", "worker", "--port", str(port), "--threads", str(threads)],
                  "worker listening", env)


def start_proxy(port: int, to: str, delay_ms: float) -> subprocess.Popen:
    return _start([sys.executable, __file__, "proxy", "--listen", str(port), "--to", to, "--delay-ms", str(delay_ms)],
                  "proxy ready")


def stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


# ------------------------------------------------------------------ the measurement
def measure(engine, prompts, n: int, k: int):
    from localspec.core.engine import GenConfig

    out = {}
    for method in ("none", "auto"):
        rates, tokens, steps, mal = [], [], {}, []
        for toks in prompts:
            engine.complete(list(toks), GenConfig(method=method, k=k, max_tokens=2))  # warm: probe, prompt cache
            fin = engine.complete(list(toks), GenConfig(method=method, k=k, max_tokens=n))
            rates.append(fin.stats.tokens_per_second)
            tokens.append(fin.tokens)
            mal.append(fin.stats.mean_accepted_length)
            for m, c in fin.stats.method_used.items():
                steps[m] = steps.get(m, 0) + c
        out[method] = {"tok_s": statistics.median(rates), "tokens": tokens, "steps": steps,
                       "len": statistics.mean(mal)}
    return out


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["proxy"]:
        return proxy_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("draft", nargs="?")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-k", type=int, default=8)
    ap.add_argument("--rtt", default="0,2,10", help="added round-trip times in ms")
    ap.add_argument("--prompts", type=int, default=2, help="how many built-in prompts (code_edit, extract, ...)")
    ap.add_argument("--threads", type=int, default=None, help="client and worker threads (default: all cores)")
    a = ap.parse_args(argv)
    # client and workers share this machine's cores: spinning OpenMP threads would take each other's cores
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.path.insert(0, str(ROOT))
    from localspec.llama.sysinfo import default_threads
    from localspec.bench.runner import load_prompts
    from localspec.core.engine import Engine

    threads = a.threads or default_threads()
    rtts = [float(x) for x in a.rtt.split(",")]
    cats = ["code_edit", "extract", "json", "code", "chat", "creative"]
    chosen = sorted(load_prompts(categories=cats, limit=1), key=lambda p: cats.index(p["category"]))
    texts = [p["prompt"] for p in chosen[: a.prompts]]
    ports = [free_port(), free_port()]
    workers = [start_worker(p, threads) for p in ports]
    t_start = time.perf_counter()
    rows = []
    reference = None
    try:
        setups = [("local", 0, 0.0)] + [(f"{w} worker{'s' if w > 1 else ''}", w, r) for r in rtts for w in (1, 2)]
        for name, n_workers, rtt in setups:
            proxies, eps = [], [f"127.0.0.1:{p}" for p in ports[:n_workers]]
            if n_workers and rtt > 0:
                pp = [free_port() for _ in eps]
                proxies = [start_proxy(lp, ep, rtt / 2) for lp, ep in zip(pp, eps)]
                eps = [f"127.0.0.1:{lp}" for lp in pp]
            try:
                t0 = time.perf_counter()
                e = Engine.load(a.target, a.draft, n_ctx=2048, threads=threads, rpc=eps or None,
                                drop_incompatible_draft=True)
                load_s = time.perf_counter() - t0
                try:
                    prompts = [e.chat_prompt([{"role": "user", "content": t}]) for t in texts]
                    r = measure(e, prompts, a.n, a.k)
                finally:
                    e.close()
            finally:
                stop(proxies)
            if reference is None:
                reference = r["none"]["tokens"]
            same = all(r[m]["tokens"] == reference for m in ("none", "auto"))
            rows.append((name, rtt if n_workers else None, r, load_s, same))
            p, s = r["none"]["tok_s"], r["auto"]["tok_s"]
            print(f"  {name:10} rtt {rtt if n_workers else '-':>4} ms: plain {p:6.1f} tok/s, auto {s:6.1f} tok/s "
                  f"({s / p:4.2f}x), load {load_s:4.1f}s", file=sys.stderr, flush=True)
    finally:
        stop(workers)
    print(f"\n{Path(a.target).name}" + (f" + {Path(a.draft).name}" if a.draft else " (lookup)")
          + f", -n {a.n}, k<={a.k}, {len(texts)} prompt(s), {threads} threads, "
          f"{time.perf_counter() - t_start:.0f}s in all")
    print(f"| setup | added RTT | plain tok/s | auto tok/s | auto/plain | auto tokens/pass | auto steps | same tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, rtt, r, load_s, same in rows:
        p, s = r["none"]["tok_s"], r["auto"]["tok_s"]
        steps = ", ".join(f"{m} {c}" for m, c in sorted(r["auto"]["steps"].items()))
        print(f"| {name} | {'-' if rtt is None else f'{rtt:g} ms'} | {p:.1f} | {s:.1f} | {s / p:.2f}x | "
              f"{r['auto']['len']:.2f} | {steps} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
