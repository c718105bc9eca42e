"""Agent clients against `localspec serve`: does each one's tool loop (and structured output) work end to end?

Runs small, fixed scripts with the openai SDK, `llm`, langchain-openai, pydantic-ai and the OpenAI Agents SDK
against a running server (--base-url) or one this script starts (--target/--draft, `localspec serve --threads 2`),
and prints one line per check (PASS/FAIL/SKIP and what was seen) and a JSON summary (--json FILE).

    python benchmarks/agents/clients.py --target ~/.cache/localspec-test-models/qwen2.5-coder-1.5b-instruct.gguf \
        --draft ~/.cache/localspec-test-models/qwen2.5-coder-0.5b-instruct.gguf --json /tmp/agents.json

A client whose package is not installed is SKIP. Answers are greedy (temperature 0) and short (max 200 tokens).
tests/test_agents_real.py runs the agent libraries' checks (llm, pydantic-ai, the Agents SDK) as tests.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager

MAX_TOKENS = 200
WEATHER = {"city": "Paris", "sky": "sunny", "temp_c": 21}
QUESTION = "What is the weather in Paris right now? Use the get_weather tool, then answer in one sentence."


def used_result(text: str | None) -> bool:
    """The final answer mentions what the tool returned."""
    t = (text or "").lower()
    return "21" in t or "sunny" in t


def weather_tool() -> dict:
    return {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                       "required": ["city"]}}}


# ------------------------------------------------------------------ the checks (each returns (ok, detail))
def check_openai_loop(base: str):
    from openai import OpenAI

    c = OpenAI(base_url=base, api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": QUESTION}]
    r = c.chat.completions.create(model="localspec", messages=msgs, tools=[weather_tool()], tool_choice="auto",
                                  max_tokens=MAX_TOKENS, temperature=0)
    ch = r.choices[0]
    if not ch.message.tool_calls:
        return False, f"no tool_calls (finish {ch.finish_reason}): {ch.message.content!r:.120}"
    call = ch.message.tool_calls[0]
    msgs += [ch.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps(WEATHER)}]
    r2 = c.chat.completions.create(model="localspec", messages=msgs, tools=[weather_tool()], max_tokens=MAX_TOKENS,
                                   temperature=0)
    text = r2.choices[0].message.content
    return used_result(text), f"call {call.function.name}({call.function.arguments}) -> {text!r:.120}"


def check_openai_stream(base: str):
    from openai import OpenAI

    c = OpenAI(base_url=base, api_key="x", max_retries=0)
    calls, finish, arg_deltas, opening_content = {}, None, 0, "unset"
    for chunk in c.chat.completions.create(model="localspec", messages=[{"role": "user", "content": QUESTION}],
                                           tools=[weather_tool()], max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        for tc in d.tool_calls or ():
            if tc.index not in calls:
                opening_content = d.content
            slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            if tc.function is not None:
                slot["name"] += tc.function.name or ""
                if tc.function.arguments:
                    arg_deltas += 1
                    slot["arguments"] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    ok = finish == "tool_calls" and bool(calls) and all(json.loads(s["arguments"] or "null") for s in calls.values())
    return ok, f"finish {finish}, calls {list(calls.values())}, argument deltas {arg_deltas}, " \
               f"opening delta content {opening_content!r}"


def check_openai_schema(base: str):
    from openai import OpenAI

    c = OpenAI(base_url=base, api_key="x", max_retries=0)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}  # no additionalProperties: strict semantics close it
    r = c.chat.completions.create(model="localspec", max_tokens=MAX_TOKENS, temperature=0, messages=[
        {"role": "user", "content": "Invent a person: name and age, plus anything else you like."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    text = r.choices[0].message.content
    try:
        keys = set(json.loads(text))
    except ValueError:
        return False, f"not JSON (finish {r.choices[0].finish_reason}): {text!r:.120}"
    return keys == {"name", "age"}, f"keys {sorted(keys)}"


def check_llm(base: str, max_tokens: int = MAX_TOKENS):
    """`llm -T` with a Python function tool (--functions), and `llm --schema`."""
    import shutil

    exe = shutil.which("llm") or os.path.join(os.path.dirname(sys.executable), "llm")
    if not os.path.exists(exe):
        return None, "llm is not installed"
    with tempfile.TemporaryDirectory() as home:
        with open(os.path.join(home, "extra-openai-models.yaml"), "w") as f:
            f.write(f"- model_id: localspec\n  model_name: localspec\n  api_base: {base}\n"
                    "  supports_tools: true\n  supports_schema: true\n")
        env = {**os.environ, "LLM_USER_PATH": home, "OPENAI_API_KEY": "x"}
        fn = ("def get_weather(city: str) -> str:\n    'Current weather for a city.'\n"
              f"    return {json.dumps(json.dumps(WEATHER))}\n")
        p = subprocess.run([exe, "-m", "localspec", "--functions", fn, "--td", "-o", "temperature", "0",
                            "-o", "max_tokens", str(max_tokens), QUESTION],
                           env=env, capture_output=True, text=True, timeout=600)
        called = "get_weather(" in p.stdout + p.stderr
        ok_tools = p.returncode == 0 and called and used_result(p.stdout.split("\n")[-2] if p.stdout else "")
        tools_detail = f"rc {p.returncode}, tool ran: {called}, out {p.stdout.strip()[-120:]!r}"
        q = subprocess.run([exe, "-m", "localspec", "--schema", "name, age int", "-o", "temperature", "0",
                            "-o", "max_tokens", str(max_tokens), "Invent a person."],
                           env=env, capture_output=True, text=True, timeout=600)
        try:
            keys = sorted(json.loads(q.stdout))
        except ValueError:
            keys = None
        ok_schema = q.returncode == 0 and keys == ["age", "name"]
    return {"tools": (ok_tools, tools_detail), "schema": (ok_schema, f"rc {q.returncode}, keys {keys}, "
                                                                    f"out {q.stdout.strip()[:120]!r}")}


def check_langchain(base: str):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        return json.dumps(WEATHER)

    llm = ChatOpenAI(base_url=base, api_key="x", model="localspec", temperature=0, max_tokens=MAX_TOKENS,
                     max_retries=0).bind_tools([get_weather])
    msgs = [HumanMessage(QUESTION)]
    ran = 0
    for _ in range(3):
        ai = llm.invoke(msgs)
        msgs.append(ai)
        if not ai.tool_calls:
            break
        for tc in ai.tool_calls:
            ran += 1
            msgs.append(ToolMessage(get_weather.invoke(tc["args"]), tool_call_id=tc["id"]))
    return ran > 0 and used_result(msgs[-1].content), f"tool ran {ran}x, final {msgs[-1].content!r:.120}"


def check_pydantic_ai(base: str, max_tokens: int = MAX_TOKENS):
    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Weather(BaseModel):
        sky: str
        temp_c: int

    class Report(BaseModel):
        city: str
        weather: Weather

    model = OpenAIChatModel("localspec", provider=OpenAIProvider(base_url=base, api_key="x"))
    agent = Agent(model, output_type=Report, model_settings={"temperature": 0, "max_tokens": max_tokens},
                  instructions="Use the tools to answer.")
    ran = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        ran.append(city)
        return json.dumps(WEATHER)

    out = agent.run_sync("What is the weather in Paris right now?").output
    # the run completes with the tool run and the nested output
    ok = bool(ran) and isinstance(out, Report) and isinstance(out.weather, Weather)
    return ok, f"tool ran {ran}, result used: {isinstance(out, Report) and out.weather.temp_c == 21}, " \
               f"output {out!r:.160}"


def check_agents_sdk(base: str, max_tokens: int = MAX_TOKENS):
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from agents.model_settings import ModelSettings
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    ran = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        ran.append(city)
        return json.dumps(WEATHER)

    model = OpenAIResponsesModel(model="localspec", openai_client=AsyncOpenAI(base_url=base, api_key="x",
                                                                              max_retries=0))
    agent = Agent(name="weather", instructions="Answer with the tools.", tools=[get_weather], model=model,
                  model_settings=ModelSettings(temperature=0, max_tokens=max_tokens))
    out = Runner.run_sync(agent, QUESTION, max_turns=4).final_output
    return bool(ran) and used_result(str(out)), f"tool ran {ran}, final {str(out)!r:.120}"


CHECKS = {
    "openai.loop": check_openai_loop,
    "openai.stream": check_openai_stream,
    "openai.schema": check_openai_schema,
    "llm": check_llm,
    "langchain": check_langchain,
    "pydantic_ai": check_pydantic_ai,
    "agents_sdk": check_agents_sdk,
}
PACKAGES = {"openai": "openai", "llm": "llm", "langchain": "langchain_openai", "pydantic_ai": "pydantic_ai",
            "agents_sdk": "agents"}


@contextmanager
def server(target: str, draft: str | None, method: str, threads: int):
    cmd = [sys.executable, "-m", "localspec", "serve", "-m", target, "--port", "0", "--threads", str(threads),
           "--method", method, "-c", "4096"] + (["-d", draft] if draft else [])
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        base = None
        for line in p.stderr:
            sys.stderr.write("  server: " + line)
            m = re.search(r"(http://\S+/v1)", line)
            if m:
                base = m.group(1)
                break
        if base is None:
            raise SystemExit("the server did not start")
        import threading

        threading.Thread(target=lambda: [sys.stderr.write("  server: " + x) for x in p.stderr], daemon=True).start()
        yield base
    finally:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def run(base: str, only: list[str] | None) -> dict:
    import importlib.util

    results = {}
    for name, fn in CHECKS.items():
        if only and not any(name.startswith(o) for o in only):
            continue
        pkg = PACKAGES[name.split(".")[0]]
        t0 = time.perf_counter()
        if importlib.util.find_spec(pkg) is None:
            got = (None, f"{pkg} is not installed")
        else:
            try:
                got = fn(base)
            except Exception as exc:
                got = (False, f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
                if os.environ.get("AGENTS_DEBUG"):
                    traceback.print_exc()
        subs = got if isinstance(got, dict) else {"": got}
        for sub, (ok, detail) in subs.items():
            key = f"{name}.{sub}" if sub else name
            results[key] = {"ok": ok, "detail": detail, "s": round(time.perf_counter() - t0, 1)}
            print(f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'}  {key:22} {detail}", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", help="a running server's /v1 URL (else --target starts one)")
    ap.add_argument("--target", help="target GGUF for the server this script starts")
    ap.add_argument("--draft", help="draft GGUF")
    ap.add_argument("--method", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", help="comma-separated check names (prefixes): openai,llm,langchain,...")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    only = a.only.split(",") if a.only else None
    if a.base_url:
        results = run(a.base_url, only)
    elif a.target:
        with server(a.target, a.draft, a.method, a.threads) as base:
            results = run(base, only)
    else:
        ap.error("give --base-url or --target")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
