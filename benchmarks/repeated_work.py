"""Repeated work: a series of prompts over a real code base (localspec's own source at a fixed revision), sent in order with empty caches
at the start, the way a shell loop, a script run again or an agent sends them. Per prompt, every configuration runs
once, interleaved, each keeping its own caches along the series:

- localspec plain (`--method none`) and `auto` (its suffix cache starts empty in a private cache dir and persists
  across the series, as it does across a user's runs); with --old CHECKOUT (once or more), each checkout's `auto`
  beside it;
- native `llama-lookup` k=3 without a cache file, and with `-lcd FILE` (its dynamic n-gram cache kept across the
  series), from the same llama.cpp source (../shared/tools/native-llama-cpp.sh).

Groups: `describe` (the same JSON description asked of 6 functions), `docstring` (a docstring for 4 functions),
`again` (3 of the prompts above sent again: a script run twice) and `control` (commit messages for small real diffs:
little overlap). Prints one line per run and a table of tok/s per group (total tokens / total seconds).

    python benchmarks/repeated_work.py [--target T.gguf] [-n 96] [--threads 2] [--bin DIR] [--old DIR ...]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = Path.home() / ".cache/localspec-test-models"
SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# (file, function) pairs from localspec's source: small functions with real names and bodies
DESCRIBE = [("localspec/seq.py", "common_prefix"), ("localspec/core/text.py", "TextAssembler.push"),
            ("localspec/llama/multiseq.py", "split_equal"), ("localspec/core/batch_cost.py", "pass_cost"),
            ("localspec/core/generation.py", "grammar_masks"), ("localspec/core/generation.py", "fit_ctx")]
DOCSTRING = [("localspec/core/text.py", "TextAssembler.flush"), ("localspec/core/response.py", "Response.result"),
             ("localspec/core/batch_cost.py", "batch_ratios"), ("localspec/core/generation.py", "no_token_left")]
CONTROL_COMMITS = 4
ANCHOR = "4f0e9e7"  # the revision the functions and diffs are read at: the same series whatever the checkout


def source_of(path: str, name: str) -> str:
    """The source of function `name` (Class.method allowed) in `path`, its docstring removed."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{ANCHOR}:{path}"], capture_output=True, text=True,
                          check=True).stdout
    tree = ast.parse(text)
    node: ast.AST = tree
    for part in name.split("."):
        node = next(n for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
    if ast.get_docstring(node):
        node.body = node.body[1:]
    return ast.unparse(node)


def series() -> list[tuple[str, str]]:
    """(group, prompt) in the order sent."""
    out = []
    for path, name in DESCRIBE:
        out.append(("describe", "Describe this Python function as JSON with the keys name, parameters (a list of "
                    "{name, type, meaning}), returns and summary. Answer with the JSON only.\n\n"
                    + source_of(path, name)))
    for path, name in DOCSTRING:
        out.append(("docstring", "Write a Google-style docstring for this Python function and return the whole "
                    "function with it:\n\n" + source_of(path, name)))
    out += [("again", p) for _, p in (out[0], out[2], out[6])]
    log = subprocess.run(["git", "-C", str(ROOT), "log", "--format=%H", "-200", ANCHOR, "--", "localspec/"],
                         capture_output=True, text=True).stdout
    n = 0
    for h in log.split():
        diff = subprocess.run(["git", "-C", str(ROOT), "show", "--format=", "--unified=1", h, "--", "localspec/"], capture_output=True,
                              text=True).stdout
        if 300 < len(diff) < 1500:
            out.append(("control", "Write a one-line commit message for this diff:\n\n" + diff))
            n += 1
        if n == CONTROL_COMMITS:
            break
    return out


def chatml(prompt: str) -> str:
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n"
            "<|im_start|>assistant\n")


def native(bin_dir: Path, tool: str, target: Path, prompt_file: Path, n: int, threads: int, extra=()) -> tuple:
    args = [str(bin_dir / tool), "-m", str(target), "-f", str(prompt_file), "-n", str(n), "--temp", "0", "-t",
            str(threads), "-fa", "on", "-ctk", "bf16", "-ctv", "bf16", "-c", "4096", *extra]
    if tool == "llama-lookup":
        args += ["--spec-draft-n-max", "3"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=600)
    out = p.stderr + p.stdout
    if tool == "llama-completion":  # "eval time = X ms / N runs" (the line that is not the prompt's)
        s = re.search(r"(?<!prompt )eval time = +([0-9.]+) ms / +(\d+) runs", out)
        if s is None:
            raise RuntimeError(f"{tool}: no timing in its output:\n{out[-2000:]}")
        return int(s.group(2)), float(s.group(1)) / 1000, {}
    s = re.search(r"decoded +(\d+) tokens in +([0-9.]+) seconds", out)
    if s is None:
        raise RuntimeError(f"{tool}: no timing in its output:\n{out[-2000:]}")
    drafted, accepted = (re.search(rf"{k} += (\d+)", out) for k in ("n_drafted", "n_accept"))
    return int(s.group(1)), float(s.group(2)), {"drafted": drafted and int(drafted.group(1)),
                                                "accepted": accepted and int(accepted.group(1))}


def localspec_run(cwd: Path, method: str, target: Path, prompt: str, n: int, threads: int, env: dict) -> tuple:
    p = subprocess.run([sys.executable, "-m", "localspec", "run", "-m", str(target), "--method", method, "-n", str(n),
                        "--threads", str(threads), "--json", "-q", prompt], cwd=cwd, capture_output=True, text=True,
                       env={**os.environ, **env, "PYTHONPATH": str(cwd)}, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"localspec ({cwd}): {p.stderr[-1500:]}")
    d = json.loads(p.stdout)
    st = d.get("stats", d)
    secs = d["completion_tokens"] / d["tokens_per_second"] if d.get("tokens_per_second") else float("nan")
    return d["completion_tokens"], secs, {"steps": st.get("steps_by_method"), "exactness": d.get("exactness")}


def record(args) -> int:
    """The series' plain greedy answers as traces (benchmarks/data/repeated_work_traces.json was made so)."""
    os.environ["LOCALSPEC_SUFFIX_CACHE"] = "0"  # plain answers: nothing to draft from, nothing to add to the user's cache
    sys.path.insert(0, str(ROOT))
    from localspec.bench.traces import record as record_traces
    from localspec.core.engine import Engine

    engine = Engine.load(args.target, n_ctx=4096, threads=args.threads)
    try:
        prompts = [{"id": f"{i}-{group}", "prompt": prompt} for i, (group, prompt) in enumerate(series()[:args.limit])]
        traces = record_traces(engine, prompts, max_tokens=args.n)
    finally:
        engine.close()
    args.record.write_text(json.dumps(traces))
    print(f"{len(traces)} traces -> {args.record}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=MODELS / "qwen2.5-coder-1.5b-instruct.gguf")
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bin", type=Path, default=Path.home() / ".cache/localspec-anchor/build/bin")
    ap.add_argument("--old", type=Path, action="append", default=[],
                    help="an older localspec checkout: its `auto` runs beside (auto-old; again for another: auto-old2)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompts (a quick check)")
    ap.add_argument("--json", type=Path, default=None, help="write every run as JSON lines here")
    ap.add_argument("--record", type=Path, default=None,
                    help="instead: record the series' greedy answers as replay traces here (ids N-GROUP; replay "
                         "them with `localspec replay FILE --series`)")
    args = ap.parse_args()
    if args.record:
        return record(args)
    work = Path(tempfile.mkdtemp(prefix="repeated-work-"))
    cfg = {"LOCALSPEC_CONFIG_DIR": str(work / "config")}  # defaults, no user config
    new_env = {**cfg, "LOCALSPEC_CACHE_DIR": str(work / "cache-new")}
    olds = [(f"auto-old{j + 1 if j else ''}", d, {**cfg, "LOCALSPEC_CACHE_DIR": str(work / f"cache-old{j}")})
            for j, d in enumerate(args.old)]
    lcd = work / "lookup-dynamic.bin"
    totals: dict = defaultdict(lambda: [0, 0.0])
    sink = open(args.json, "w") if args.json else None
    for i, (group, prompt) in enumerate(series()[:args.limit]):
        pf = work / f"{i}.txt"
        pf.write_text(chatml(prompt))
        runs = [("native-plain", lambda: native(args.bin, "llama-completion", args.target, pf, args.n, args.threads,
                                                ["-no-cnv", "--no-display-prompt"])),
                ("native-lookup3", lambda: native(args.bin, "llama-lookup", args.target, pf, args.n, args.threads)),
                ("native-lookup3-lcd", lambda: native(args.bin, "llama-lookup", args.target, pf, args.n, args.threads,
                                                      ["-lcd", str(lcd)])),
                ("plain", lambda: localspec_run(ROOT, "none", args.target, prompt, args.n, args.threads, new_env)),
                ("auto", lambda: localspec_run(ROOT, "auto", args.target, prompt, args.n, args.threads, new_env))]
        for label, d, env in olds:
            runs.append((label, lambda d=d, env=env: localspec_run(d, "auto", args.target, prompt, args.n,
                                                                   args.threads, env)))
        for label, fn in runs:
            tokens, secs, extra = fn()
            totals[(group, label)][0] += tokens
            totals[(group, label)][1] += secs
            line = {"i": i, "group": group, "config": label, "tokens": tokens, "seconds": round(secs, 3),
                    "tok_s": round(tokens / secs, 2) if secs else None, **extra}
            print(json.dumps(line), flush=True)
            if sink:
                sink.write(json.dumps(line) + "\n")
    order = ["native-plain", "native-lookup3", "native-lookup3-lcd", "plain", "auto"] + [o[0] for o in olds]
    labels = sorted({k[1] for k in totals}, key=order.index)
    groups = ["describe", "docstring", "again", "control", "all"]
    for lab in labels:
        totals[("all", lab)] = [sum(totals[(g, lab)][0] for g in groups[:-1]),
                                sum(totals[(g, lab)][1] for g in groups[:-1])]
    print("| group | " + " | ".join(labels) + " |")
    print("|---" * (len(labels) + 1) + "|")
    for g in groups:
        print(f"| {g} | " + " | ".join(f"{totals[(g, lab)][0] / totals[(g, lab)][1]:.1f}"
                                       if totals[(g, lab)][1] else "-" for lab in labels) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
