"""Draft heads, localspec vs native llama.cpp: drafted and accepted counts on the same fabricated models and prompt,
side by side, and the per-step cost of the after-decode hook each head adds to every target decode.

    python benchmarks/heads_native.py [--bin DIR] [-n 48] [-k 3] [--prompt TEXT] [--steps 400]

Models (tests/tinyheads.py, written to a temporary directory): the bigram target (llama arch, next token pi(t))
with an agreeing EAGLE-3 head and an agreeing DFlash head, and the glm4moe target whose MTP layer is wrong for 30%
of the tokens. Both sides decode greedily with k drafted tokens at most and no confidence cut (p_min 0).

Native: `llama-speculative-simple --spec-type draft-eagle3|draft-mtp|draft-dflash` (BIN, default the anchor build).
Its loop decodes prompt[:-1] first and drafts from the last prompt token, once per step, counting only the drafts it
verifies; localspec decodes the whole prompt, samples the first token from it, then drafts from that token: the
native loop is one step behind (its first draft predicts the token localspec's prefill already produced), so the
counts can differ by one step's worth. The hook overhead is the time in after_target_decode per target decode
(time.perf_counter_ns around the call, over --steps decodes), reported, never asserted.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # tinyheads, tinymodels

NATIVE_TYPE = {"eagle3": "draft-eagle3", "mtp": "draft-mtp", "dflash": "draft-dflash"}


def fabricate(d: Path) -> dict[str, tuple[Path, Path | None]]:
    from tinyheads import write_bigram_target, write_dflash, write_eagle3, write_glm4moe_mtp

    t = write_bigram_target(d / "bigram.gguf", 7)
    return {"eagle3": (t, write_eagle3(d / "eagle3.gguf", 3, agree_with=7)),
            "dflash": (t, write_dflash(d / "dflash.gguf", 3, agree_with=7)),
            "mtp": (write_glm4moe_mtp(d / "glm-mtp.gguf", 7), None)}


def run_localspec(kind: str, target: Path, head: Path | None, prompt: str, n: int, k: int) -> dict:
    from localspec.core.engine import Engine, GenConfig

    e = Engine.load(target, head, n_ctx=1024, threads=2)
    try:
        r = e.complete(e.raw_prompt(prompt), GenConfig(method=kind, max_tokens=n, k=k, p_min=0.0,
                                                        exactness="lossless"))
        return {"drafted": r.stats.drafted, "accepted": r.stats.accepted, "tokens": len(r.tokens)}
    finally:
        e.close()


def run_native(bin_dir: Path, kind: str, target: Path, head: Path | None, prompt: str, n: int, k: int) -> dict:
    exe = bin_dir / "llama-speculative-simple"
    if not exe.is_file():
        return {"error": f"{exe} not found"}
    cmd = [str(exe), "-m", str(target), "--spec-type", NATIVE_TYPE[kind], "-p", prompt, "-n", str(n), "--temp", "0",
           "-c", "1024", "-t", "2", "--spec-draft-n-max", str(k), "--spec-draft-p-min", "0", "--seed", "1"]
    if head is not None:
        cmd += ["-md", str(head)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=300)
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    out = r.stdout + r.stderr
    got = {}
    for key, pat in (("drafted", r"n_drafted\s*=\s*(\d+)"), ("accepted", r"n_accept\s*=\s*(\d+)"),
                     ("tokens", r"n_predict\s*=\s*(\d+)")):
        m = re.search(pat, out)
        if m:
            got[key] = int(m.group(1))
    if "drafted" not in got:
        tail = [x for x in out.splitlines() if x.strip()][-3:]
        return {"error": f"exit {r.returncode}: " + " | ".join(tail)}
    return got


def hook_overhead(kind: str, target: Path, head: Path | None, prompt: str, steps: int) -> float:
    """Mean µs in the head's after_target_decode per one-token target decode (plain decoding, the hook called after
    each decode as the engine does)."""
    import numpy as np

    from localspec.drafters.registry import HEADS
    from localspec.llama.model import Model

    t = Model(target, n_ctx=steps + 64, n_threads=2, load_mtp=(kind == "mtp"))
    d = HEADS[kind].load(t, head)
    try:
        toks = t.tokenize(prompt)
        logits = t.decode(toks, "last")[0]
        d.after_target_decode(toks, range(len(toks)))
        pos, tok, spent = len(toks), int(np.argmax(logits)), 0
        for _ in range(steps):
            logits = t.decode([tok], "last")[0]
            t0 = time.perf_counter_ns()
            d.after_target_decode([tok], [pos])
            spent += time.perf_counter_ns() - t0
            pos += 1
            tok = int(np.argmax(logits))
        return spent / steps / 1000.0
    finally:
        d.close()
        t.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", type=Path, default=Path(os.environ.get(
        "BIN", Path.home() / ".cache/localspec-anchor/build/bin")))
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--prompt", default="the cat and the dog")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--kinds", default="eagle3,mtp,dflash")
    a = ap.parse_args()
    os.environ.setdefault("LOCALSPEC_NO_COST_CALIBRATION", "1")
    with tempfile.TemporaryDirectory() as tmp:
        models = fabricate(Path(tmp))
        print(f"prompt {a.prompt!r}, n={a.n}, k={a.k}, greedy, p_min 0")
        print(f"{'head':8} {'localspec drafted/accepted/tokens':>36} {'native drafted/accepted/tokens':>32} "
              f"{'hook µs/decode':>16}")
        for kind in a.kinds.split(","):
            target, head = models[kind]
            ls = run_localspec(kind, target, head, a.prompt, a.n, a.k)
            nat = run_native(a.bin, kind, target, head, a.prompt, a.n, a.k)
            us = hook_overhead(kind, target, head, a.prompt, a.steps)
            n_txt = nat["error"] if "error" in nat else f"{nat['drafted']}/{nat['accepted']}/{nat.get('tokens', '?')}"
            l_txt = f"{ls['drafted']}/{ls['accepted']}/{ls['tokens']}"
            print(f"{kind:8} {l_txt:>36} {n_txt:>32} {us:>16.1f}")


if __name__ == "__main__":
    main()
