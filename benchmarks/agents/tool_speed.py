"""Speculation on a tool-call answer: acceptance and tok/s of the same tool_choice auto request under method auto
(and draft) against none, through `localspec serve` (the call is held to its schema by the lazy grammar once the
model starts it).

    python benchmarks/agents/tool_speed.py --target ~/.cache/localspec-test-models/qwen2.5-coder-1.5b-instruct.gguf \\
        --draft ~/.cache/localspec-test-models/qwen2.5-coder-0.5b-instruct.gguf --rounds 3

Each round asks the first turn (the model writes the call) and the second turn (it answers with the tool's result),
once per method, interleaved; prints per-method medians and whether the texts were identical across methods.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from clients import QUESTION, WEATHER, server, weather_tool  # noqa: E402


FIGURES = ("tokens_per_second", "acceptance_rate", "drafted", "accepted", "k_in_use", "ttft_s", "elapsed_s")


SAVE = {"type": "function", "function": {
    "name": "save_file", "description": "Write a file in the project.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                   "required": ["path", "content"]}}}
SCENARIOS = {  # name: (first user message, tools): a short call, and a call whose arguments are code
    "weather": (QUESTION, [weather_tool()]),
    "save_file": ("Write a Python function is_prime(n) and save it to prime.py with the save_file tool.", [SAVE]),
}


def ask(c, msgs, method: str, max_tokens: int, tools):
    r = c.chat.completions.create(model="localspec", messages=msgs, tools=tools, tool_choice="auto",
                                  max_tokens=max_tokens, temperature=0, extra_body={"localspec": {"method": method}})
    st = r.model_extra["localspec"]
    return r, {**{k: st.get(k) for k in FIGURES}, "used": st.get("method")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url")
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", default="none,auto,draft")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--scenario", choices=list(SCENARIOS), default="weather")
    ap.add_argument("--json", help="write the per-request figures here")
    a = ap.parse_args()
    methods = a.methods.split(",")

    def run(base: str) -> list[dict]:
        from openai import OpenAI

        c = OpenAI(base_url=base, api_key="x", max_retries=0, timeout=900)
        rows = []
        ask(c, [{"role": "user", "content": "Say hi."}], "none", 4, None)  # warm-up (caches, first request)
        for rnd in range(a.rounds):
            for method in methods:
                question, tools = SCENARIOS[a.scenario]
                msgs = [{"role": "user", "content": question}]
                r, st = ask(c, msgs, method, a.max_tokens, tools)
                m = r.choices[0].message
                rows.append({"round": rnd, "method": method, "turn": "call", "finish": r.choices[0].finish_reason,
                             "text": json.dumps([t.function.model_dump() for t in m.tool_calls or []]) or m.content,
                             **st, "completion_tokens": r.usage.completion_tokens})
                if m.tool_calls:
                    msgs += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id,
                                                              "content": json.dumps(WEATHER)}]
                    r, st = ask(c, msgs, method, a.max_tokens, tools)
                    rows.append({"round": rnd, "method": method, "turn": "answer",
                                 "finish": r.choices[0].finish_reason, "text": r.choices[0].message.content,
                                 **st, "completion_tokens": r.usage.completion_tokens})
        return rows

    if a.base_url:
        rows = run(a.base_url)
    else:
        with server(a.target, a.draft, "auto", a.threads) as base:
            rows = run(base)
    for turn in ("call", "answer"):
        texts = {r["text"] for r in rows if r["turn"] == turn}
        print(f"{turn}: {len(texts)} distinct text(s) across methods and rounds")
        for method in methods:
            rs = [r for r in rows if r["turn"] == turn and r["method"] == method]
            if not rs:
                continue
            tps = statistics.median(r["tokens_per_second"] or 0 for r in rs)
            acc = [r["acceptance_rate"] for r in rs if r["acceptance_rate"] is not None]
            decode = statistics.median(r["completion_tokens"] / max(1e-9, r["elapsed_s"] - r["ttft_s"]) for r in rs)
            print(f"  {method:6} tok/s {tps:5.2f} (after the first token {decode:5.2f})  acceptance "
                  f"{statistics.median(acc) if acc else float('nan'):.2f}  tokens {rs[0]['completion_tokens']}  "
                  f"finish {rs[0]['finish']}  used {sorted({r['used'] for r in rs})}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
