"""Replay the speculation controller on recorded answers, without a model and without timing noise.

At temperature 0 the target's answer to a prompt is fixed, so what a drafter proposes at each step and how much of
it the target accepts follow from the recorded tokens alone; a step's cost is T(b)/T(1) from a verify curve (the
calibration `localspec` measures per machine). Replaying `auto` and fixed settings over the same record compares
their choices exactly: the same figures every run, where timed runs on a 2-core machine spread by 5-10%.

    python -m localspec.bench.replay TRACES.json [--tokens N] [--curve avx2|avx512|epyc|flat]

Record traces with `record()` (a loaded Engine and prompts): each is {"id", "prompt": [...], "output": [...]}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Callable, Sequence

from localspec.core.policy import AdaptivePolicy, FixedPolicy, Policy
from localspec.drafters.prompt_lookup import PromptLookupDrafter

# T(b)/T(1) for b = 1..9 rows, Qwen2.5-Coder-1.5B Q4_K_M with 2 threads (localspec's calibration on each machine)
CURVES = {
    "avx2": {1: 1.0, 2: 1.60, 3: 2.19, 4: 2.67, 5: 3.27, 6: 3.81, 7: 4.46, 8: 6.64, 9: 7.07},
    "avx512": {1: 1.0, 2: 1.5, 3: 1.9, 4: 1.65, 5: 2.2, 6: 2.5, 7: 2.8, 8: 3.0, 9: 3.2},
    "epyc": {1: 1.0, 2: 1.75, 3: 2.25, 4: 2.85, 5: 3.45, 6: 3.95, 7: 4.55, 8: 4.7, 9: 5.05},  # AMD EPYC, AVX-512
    "flat": {b: 1.0 + 0.02 * (b - 1) for b in range(1, 10)},  # a GPU: a batch of 9 costs about one row
}
T1 = 0.065  # seconds per one-token step (only scales the figures)


def step_cost(curve: dict[int, float], rows: int) -> float:
    if rows in curve:
        return T1 * curve[rows]
    top = max(curve)
    return T1 * (curve[top] + (curve[top] - curve[top - 1]) * (rows - top))


def replay(trace: dict, make_policy: Callable[[], Policy], curve: dict[int, float], n: int | None = None) -> dict:
    """Decode `trace` again under the policy: returns tokens/s (simulated), steps and acceptance counts."""
    prompt = [int(t) for t in trace["prompt"]]
    out = [int(t) for t in trace["output"]][:n]
    policy = make_policy()
    for d in policy.drafters.values():
        d.begin(prompt)
    ctx = prompt + out[:1]  # the first token comes from the prompt's own pass
    i, t = 1, 0.0
    steps = spec = drafted = accepted = 0
    while i < len(out):
        drafter, k = policy.choose(ctx)
        k = max(0, min(k, len(out) - i - 1))
        tokens = drafter.propose(ctx, k, None, None).tokens if (drafter is not None and k > 0) else []
        n_acc = 0
        while n_acc < len(tokens) and tokens[n_acc] == out[i + n_acc]:
            n_acc += 1
        cost = step_cost(curve, len(tokens) + 1)
        t += cost
        policy.observe(drafter, k, len(tokens), n_acc, 1e-6 if tokens else None, cost)
        if drafter is not None and tokens:
            drafter.accept(len(tokens), n_acc)
            spec += 1
            drafted += len(tokens)
            accepted += n_acc
        new = out[i:i + n_acc + 1]
        ctx += new
        i += len(new)
        steps += 1
    return {"rate": (len(out) - 1) / t if t else 0.0, "steps": steps, "spec_steps": spec, "drafted": drafted,
            "accepted": accepted, "switched": getattr(policy, "switched", None)}


def plain() -> Callable[[], Policy]:
    return lambda: FixedPolicy(None, 0)


def lookup(k: int) -> Callable[[], Policy]:
    return lambda: FixedPolicy(PromptLookupDrafter(), k)


def auto(curve: dict[int, float], k_max: int = 4, bit_cap: int | None = 2) -> Callable[[], Policy]:
    """`auto` with prompt lookup as `localspec run` builds it (the draft model left out: it never pays on a CPU)."""
    return lambda: AdaptivePolicy({"lookup": PromptLookupDrafter()}, k_max, {}, None, dict(curve), bit_cap=bit_cap)


def table(traces: Sequence[dict], curve: dict[int, float], n: int | None = None) -> dict[str, dict[str, float]]:
    """Speedup over plain per config and trace id."""
    configs = {"plain": plain(), **{f"lookup k={k}": lookup(k) for k in (1, 2, 3, 4, 8)},
               "auto (bit cap 2)": auto(curve, 4, 2), "auto (lossless)": auto(curve, 4, None)}
    base = {tr["id"]: replay(tr, plain(), curve, n)["rate"] for tr in traces}
    return {name: {tr["id"]: replay(tr, mk, curve, n)["rate"] / base[tr["id"]] for tr in traces}
            for name, mk in configs.items()}


def record(engine, prompts: Sequence[dict], max_tokens: int = 160) -> list[dict]:
    """Greedy answers of the engine's target to each {"id", "prompt"} (chat-rendered), for replay()."""
    from localspec.core.engine import GenConfig

    out = []
    for p in prompts:
        toks = engine.chat_prompt([{"role": "user", "content": p["prompt"]}])
        fin = engine.complete(toks, GenConfig(method="none", max_tokens=max_tokens))
        out.append({"id": p["id"], "prompt": toks, "output": fin.tokens})
    return out


MAX_BYTES = 64 << 20  # a trace file is read up to this: a device or an endless stream is refused, not exhausted


class TraceError(Exception):
    """A trace file or argument that cannot be replayed: one line for the user."""


def _tokens(v, what: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise TraceError(f"{what} must be a list of token ids (whole numbers >= 0)")
    return v


def load(path) -> list[dict]:
    """The traces in `path` (a JSON list of traces, or {"traces": [...]}), each checked: a string or number "id"
    (unique), a "prompt" and an "output" of token ids, the output at least 2 tokens (the first comes from the
    prompt's own pass; replay times the rest)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except IsADirectoryError:
        raise TraceError(f"{path} is a folder, not a trace file") from None
    except FileNotFoundError:
        raise TraceError(f"no such file: {path}") from None
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_BYTES:
        raise TraceError(f"{path} is too large for a trace file (more than {MAX_BYTES >> 20} MiB)")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise TraceError(f"{path} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise TraceError(f"{path} is not valid JSON here: it is nested too deep") from None
    traces = data.get("traces") if isinstance(data, dict) else data
    if not isinstance(traces, list):
        raise TraceError(f"{path} must hold a list of traces (or {{\"traces\": [...]}})")
    if not traces:
        raise TraceError(f"{path} holds no traces")
    seen = set()
    for i, tr in enumerate(traces, 1):
        where = f"{path}: trace {i}"
        if not isinstance(tr, dict):
            raise TraceError(f"{where} must be an object with id, prompt and output")
        if not isinstance(tr.get("id"), (str, int)) or isinstance(tr.get("id"), bool):
            raise TraceError(f"{where}: id must be a string or a number")
        if str(tr["id"]) in seen:
            raise TraceError(f"{where}: id {tr['id']!r} is used twice")
        seen.add(str(tr["id"]))
        _tokens(tr.get("prompt"), f"{where}: prompt")
        if len(_tokens(tr.get("output"), f"{where}: output")) < 2:
            raise TraceError(f"{where}: output needs at least 2 tokens")
    return [{**tr, "id": str(tr["id"])} for tr in traces]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's usage block becomes the one error line every front end prints
        raise TraceError(f"{message} (see --help)")


def main(argv: Sequence[str] | None = None) -> int:
    ap = _Parser(prog="python -m localspec.bench.replay", description=__doc__.splitlines()[0])
    ap.add_argument("traces")
    ap.add_argument("--tokens", type=int, default=None, help="replay at most N tokens of each answer (N >= 2)")
    ap.add_argument("--curve", choices=sorted(CURVES), default="avx2")
    try:
        a = ap.parse_args(argv)
        if a.tokens is not None and a.tokens < 2:
            raise TraceError(f"--tokens must be at least 2 (the first token is not timed), got {a.tokens}")
        traces = load(a.traces)
    except TraceError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    rows = table(traces, CURVES[a.curve], a.tokens)
    ids = [tr["id"] for tr in traces]
    try:
        print(f"{'':18}" + "".join(f"{i[:10]:>11}" for i in ids) + "    geomean")
        for name, r in rows.items():
            g = math.exp(sum(math.log(r[i]) for i in ids) / len(ids))
            print(f"{name:18}" + "".join(f"{r[i]:11.3f}" for i in ids) + f"{g:11.3f}")
        sys.stdout.flush()
    except BrokenPipeError:  # `| head`: the reader stopped reading, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
