"""Speculation on fabricated recurrent/hybrid targets: tok/s of plain, lookup and auto, with RS rollback and with
checkpoint + replay side by side, checkpoint size, save/restore time and replayed tokens per 100 generated.

    python benchmarks/hybrid_bench.py [--threads 2] [-n 128] [--dir /tmp/hybrid-bench]

The models are random (tests/tinymodels.py fabricators, ~20-50 MB): acceptance depends on how repetitive their
output is, so read the tok/s as cost of the machinery, not as a forecast for a real model.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tinymodels import write_lfm2, write_mamba  # noqa: E402

PROMPT = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
          "the cat and the dog and the cat and the dog and the")


def run(path: Path, rollback: str, threads: int, n: int, rounds: int) -> list[dict]:
    """One warm-up round, then `rounds` interleaved rounds of plain, lookup and auto; tok/s is the best round's
    (a shared machine's load only ever slows a run down), the counts are the last round's."""
    from localspec.core.engine import Engine, GenConfig

    if rollback == "checkpoint":
        os.environ["LOCALSPEC_ROLLBACK"] = "checkpoint"
    else:
        os.environ.pop("LOCALSPEC_ROLLBACK", None)
    e = Engine.load(path, None, n_ctx=1024, threads=threads)
    best: dict[str, dict] = {}
    try:
        prompt = e.raw_prompt(PROMPT)
        plain = None
        for rnd in range(rounds + 1):
            for method in ("none", "lookup", "auto"):
                cfg = GenConfig(method=method, k=4, max_tokens=n,
                                exactness="lossless" if method == "lookup" else "auto")
                e.target.clear()  # every run decodes the prompt afresh
                dec0 = e.target.decode_s
                t0 = time.perf_counter()
                r = e.complete(prompt, cfg)
                wall = time.perf_counter() - t0
                s = r.stats
                if method == "none":
                    plain = r.tokens
                if rnd == 0:
                    continue
                row = dict(model=path.name, rollback=e.target.rollback_kind, method=method,
                           tok_s=max(s.tokens_per_second, best.get(method, {}).get("tok_s", 0.0)),
                           same=r.tokens == plain, acc=s.acceptance_rate, drafted=s.drafted, restores=s.restores,
                           rs=s.rs_rollbacks, replay_per_100=100.0 * s.replayed_tokens / max(s.completion_tokens, 1),
                           ckpt_kib=s.checkpoint_bytes / 1024,
                           save_restore_ms=1000 * s.rollback_s / max(s.restores + 1, 1), wall=wall,
                           decode_ms_per_token=1000 * (e.target.decode_s - dec0) / max(s.completion_tokens, 1),
                           steps=dict(s.method_used))
                row["same"] = row["same"] and best.get(method, {}).get("same", True)
                best[method] = row
        best["auto"]["totals"] = e.target.rollback_counters()
    finally:
        e.close()
    return [best[m] for m in ("none", "lookup", "auto")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--dir", default="/tmp/hybrid-bench")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", choices=("lfm2", "mamba"), default=None)
    a = ap.parse_args()
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    lfm2 = d / "lfm2-bench.gguf"
    mamba = d / "mamba-bench.gguf"
    if not lfm2.exists():
        write_lfm2(lfm2, 4, n_embd=512, n_ff=1536, n_head=8, layers="ccaccacc")
    if not mamba.exists():
        write_mamba(mamba, 3, n_embd=512, n_layer=8, d_state=16, dt_rank=32)
    print(f"lfm2 {lfm2.stat().st_size / 2**20:.1f} MiB, mamba {mamba.stat().st_size / 2**20:.1f} MiB, "
          f"threads {a.threads}, {a.n} tokens")
    hdr = (f"{'model':18} {'rollback':10} {'method':7} {'tok/s':>7} {'same':>5} {'acc':>5} {'restores':>8} "
           f"{'rs':>4} {'replay/100':>10} {'ckpt KiB':>9} {'save+rst ms':>11}")
    print(hdr)
    for path, kinds in ((lfm2, ("rs", "checkpoint")), (mamba, ("checkpoint",))):
        if a.only and not path.name.startswith(a.only):
            continue
        for kind in kinds:
            for r in run(path, kind, a.threads, a.n, a.rounds):
                print(f"{r['model']:18} {r['rollback']:10} {r['method']:7} {r['tok_s']:7.1f} {str(r['same']):>5} "
                      f"{r['acc']:5.2f} {r['restores']:8d} {r['rs']:4d} {r['replay_per_100']:10.1f} "
                      f"{r['ckpt_kib']:9.1f} {r['save_restore_ms']:11.3f}  drafted {r['drafted']} "
                      f"decode {r['decode_ms_per_token']:.1f} ms/token "
                      f"wall {r['wall']:.1f}s {r['steps']}")
                if r.get("totals"):
                    t = r["totals"]
                    n_ops = max(t["restores"], 1)
                    print(f"{'':18} totals: restores {t['restores']}, save {1000 * t['save_s']:.2f} ms total, "
                          f"restore {1000 * t['restore_s'] / n_ops:.3f} ms each")


if __name__ == "__main__":
    main()
