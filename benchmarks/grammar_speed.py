"""Grammar-constrained speculative decoding: tok/s and acceptance for one JSON-schema answer with methods none,
lookup and auto (or any list), interleaved in the same run, and the per-step cost of the grammar (llguidance's
mask computation, consume and rollback, timed around the constraint the server would use).

Usage: python benchmarks/grammar_speed.py TARGET.gguf [DRAFT.gguf] [-n 256] [--rounds 3] [--methods none,lookup,auto]
       [-k 8] [--ctx 4096] [--exactness auto] [--threads N]

e.g. the Qwen pair:
  python benchmarks/grammar_speed.py ~/.cache/localspec-test-models/qwen2.5-coder-1.5b-instruct.gguf \\
      ~/.cache/localspec-test-models/qwen2.5-coder-0.5b-instruct.gguf

Each round runs every method once on the same prompt (prompt cache warm: the first, untimed run decodes it), so the
ratios are within one run. Columns (medians over rounds): tok/s of generation (first token to last), x none,
acceptance (accepted / drafted), tokens per target pass, masks per target pass, grammar ms per target pass (mask +
consume + rollback), the grammar's share of generation time, and whether the answer equals method none's and
parses as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from localspec.core.engine import Engine, GenConfig

PROMPT = ("List three Python web frameworks as JSON: for each its name, the year it was first released, its license "
          "and a one-sentence summary.")
SCHEMA = {
    "type": "object",
    "properties": {"frameworks": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 40},
                       "year": {"type": "integer", "minimum": 1990, "maximum": 2030},
                       "license": {"enum": ["MIT", "BSD", "Apache-2.0", "GPL", "other"]},
                       "summary": {"type": "string", "maxLength": 200}},
        "required": ["name", "year", "license", "summary"], "additionalProperties": False}}},
    "required": ["frameworks"], "additionalProperties": False,
}


class Timed:
    """A constraint (server/grammar.py's Grammar) with each call timed."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.t = {"allowed": 0.0, "consume": 0.0, "rollback": 0.0}
        self.n = {"allowed": 0, "consume": 0, "rollback": 0}

    def _call(self, name, *a):
        t0 = time.perf_counter()
        try:
            return getattr(self.inner, name)(*a)
        finally:
            self.t[name] += time.perf_counter() - t0
            self.n[name] += 1

    def allowed(self):
        return self._call("allowed")

    def consume(self, tokens):
        return self._call("consume", tokens)

    def rollback(self, n):
        return self._call("rollback", n)


def constraint(target):
    from localspec.server.grammar import Grammar, grammar_of

    fmt = {"type": "json_schema", "json_schema": {"name": "frameworks", "schema": SCHEMA}}
    return Timed(Grammar(grammar_of(fmt), target))


def run_once(e: Engine, toks, method: str, a) -> dict:
    con = constraint(e.target)
    cfg = GenConfig(method=method, k=a.k if method != "none" else 0, max_tokens=a.n, exactness=a.exactness,
                    constraint=con)
    fin = e.complete(toks, cfg)
    st = fin.stats
    passes = max(st.target_passes, 1)
    gram = sum(con.t.values())
    gen = max(st.generation_s, 1e-9)
    try:
        json.loads(fin.text)
        valid = True
    except ValueError:
        valid = False
    return {"text": fin.text, "tok/s": st.tokens_per_second, "accept": st.acceptance_rate,
            "tok/pass": st.completion_tokens / passes, "masks/pass": con.n["allowed"] / passes,
            "gram ms/pass": 1e3 * gram / passes, "mask ms": 1e3 * con.t["allowed"] / max(con.n["allowed"], 1),
            "gram %": 100 * gram / gen, "len": st.completion_tokens, "valid": valid, "finish": fin.finish_reason}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("draft", nargs="?")
    ap.add_argument("-n", type=int, default=256, help="max tokens per answer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", default="none,lookup,auto")
    ap.add_argument("-k", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--exactness", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    e = Engine.load(a.target, a.draft, n_ctx=a.ctx, threads=a.threads)
    try:
        toks = e.chat_prompt([{"role": "user", "content": PROMPT}])
        run_once(e, toks, "none", a)  # untimed: decodes the prompt, builds llguidance's tokenizer
        rows: dict[str, list[dict]] = {m: [] for m in methods}
        for _ in range(a.rounds):
            for m in methods:  # interleaved: machine noise hits every method alike
                rows[m].append(run_once(e, toks, m, a))
        ref = rows[methods[0]][0]["text"] if methods[0] == "none" else None
        base = statistics.median(r["tok/s"] for r in rows[methods[0]])
        cols = ["tok/s", "accept", "tok/pass", "masks/pass", "gram ms/pass", "mask ms", "gram %"]
        print(f"target {e.target.name}" + (f", draft {e.draft.name}" if e.draft is not None else "")
              + f"; {a.rounds} rounds, max {a.n} tokens, k {a.k}, exactness {a.exactness}")
        print(f"{'method':8} " + " ".join(f"{c:>12}" for c in cols)
              + f" {'x ' + methods[0]:>9} {'len':>5} {'same':>5} {'json':>5}")
        for m in methods:
            med = {c: statistics.median(r[c] for r in rows[m]) for c in cols}
            same = "-" if ref is None else str(all(r["text"] == ref for r in rows[m])).lower()
            valid = str(all(r["valid"] for r in rows[m])).lower()
            print(f"{m:8} " + " ".join(f"{med[c]:12.3f}" for c in cols)
                  + f" {med['tok/s'] / base if base else 0:9.2f} {rows[m][-1]['len']:5d} {same:>5} {valid:>5}")
    finally:
        e.close()


if __name__ == "__main__":
    main()
