"""Agent clients against `localspec serve` on the default pair (Qwen2.5-Coder-1.5B + 0.5B): tool loops with
tool_choice auto as the model really writes its calls (a fenced, indented JSON block), strict JSON schemas, the
Responses API and the agent libraries' own loops. Skipped when the models are absent; a client whose package is
not installed is skipped (CI installs only openai)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import openai
import pytest

from conftest import REAL_MODELS
from helpers import clean_env, serving

TARGET = REAL_MODELS / "qwen2.5-coder-1.5b-instruct.gguf"
DRAFT = REAL_MODELS / "qwen2.5-coder-0.5b-instruct.gguf"
WEATHER = {"city": "Paris", "sky": "sunny", "temp_c": 21}
QUESTION = "What is the weather in Paris right now? Use the get_weather tool, then answer in one sentence."
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
N = 160  # max tokens per answer


def used_result(text) -> bool:
    t = str(text or "").lower()
    return "21" in t or "sunny" in t


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    for p in (TARGET, DRAFT):
        if not p.is_file():
            pytest.skip(f"real model absent: {p} (run ../shared/models/fetch-real-models.sh)")
    from localspec.server.config import ServerConfig
    from localspec.session import Session

    with pytest.MonkeyPatch.context() as mp:
        clean_env(mp, tmp_path_factory.mktemp("cfg"))
        sess = Session({"model": str(TARGET), "draft": str(DRAFT), "ctx_size": 4096, "threads": 2,
                        "temperature": 0.0, "max_tokens": N}, quiet=True)
        sess.load()
        try:
            with serving(sess, ServerConfig()) as s:
                yield s
        finally:
            sess.close()


def client(s):
    return s.client(max_retries=0, timeout=600)


def test_a_two_turn_tool_loop_with_auto_uses_the_tools_result(qwen):
    c = client(qwen)
    msgs = [{"role": "user", "content": QUESTION}]
    r = c.chat.completions.create(model="x", messages=msgs, tools=[TOOL], tool_choice="auto", max_tokens=N)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch.message.content
    call = ch.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"].lower() == "paris"
    msgs += [ch.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps(WEATHER)}]
    r2 = c.chat.completions.create(model="x", messages=msgs, tools=[TOOL], max_tokens=N)
    assert r2.choices[0].finish_reason == "stop" and used_result(r2.choices[0].message.content), r2


def test_a_streamed_call_has_its_arguments_in_pieces_and_speculation_stays_on(qwen):
    c = client(qwen)
    kw = dict(model="x", messages=[{"role": "user", "content": QUESTION}], tools=[TOOL], max_tokens=N)
    calls, finish, pieces, first, drafted = {}, None, 0, None, 0
    for chunk in c.chat.completions.create(stream=True, extra_body={"localspec": {"method": "draft"}}, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        first = first or d
        for tc in d.tool_calls or ():
            slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
            pieces += bool(tc.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
        stats = chunk.model_extra.get("localspec") or {}
        if stats:
            drafted = stats["drafted"]
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather" and pieces > 1
    assert first.tool_calls and first.content is None
    assert drafted > 0
    # the same call without speculation (temperature 0)
    plain = c.chat.completions.create(extra_body={"localspec": {"method": "none"}}, **kw).choices[0].message
    assert json.loads(plain.tool_calls[0].function.arguments) == json.loads(calls[0]["arguments"])


def test_json_schema_without_additional_properties_gives_only_the_declared_keys(qwen):
    c = client(qwen)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    r = c.chat.completions.create(model="x", max_tokens=N, messages=[
        {"role": "user", "content": "Invent a person: name and age, plus anything else you like."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    assert set(json.loads(r.choices[0].message.content)) == {"name", "age"}


def test_a_responses_api_function_call_round_trip(qwen):
    c = client(qwen)
    tool = {"type": "function", **TOOL["function"]}
    r = c.responses.create(model="x", input=QUESTION, tools=[tool], max_output_tokens=N)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather", r.output
    r2 = c.responses.create(model="x", tools=[tool], max_output_tokens=N, input=[
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": json.dumps(WEATHER)}])
    assert r2.status == "completed" and used_result(r2.output_text), r2.output_text


def test_llm_runs_a_python_function_tool(qwen, tmp_path):
    """`llm -T` / `--functions`: the tool runs and its result reaches the answer."""
    pytest.importorskip("llm")
    exe = shutil.which("llm") or os.path.join(os.path.dirname(sys.executable), "llm")
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: localspec\n  model_name: localspec\n  api_base: {qwen.url}/v1\n"
        "  supports_tools: true\n  supports_schema: true\n")
    fn = "def get_weather(city: str) -> str:\n    'Current weather for a city.'\n" \
         f"    return {json.dumps(json.dumps(WEATHER))}\n"
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "OPENAI_API_KEY": "x"}
    p = subprocess.run([exe, "-m", "localspec", "--functions", fn, "--td", "-o", "max_tokens", str(N), QUESTION],
                       env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr
    assert "get_weather(" in p.stdout + p.stderr and used_result(p.stdout.strip().splitlines()[-1]), p.stdout
    q = subprocess.run([exe, "-m", "localspec", "--schema", "name, age int", "-o", "max_tokens", str(N),
                        "Invent a person."], env=env, capture_output=True, text=True, timeout=900)
    assert q.returncode == 0 and sorted(json.loads(q.stdout)) == ["age", "name"], q.stdout


def test_a_pydantic_ai_agent_with_a_nested_output_type_and_a_tool_completes(qwen):
    pytest.importorskip("pydantic_ai")
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

    model = OpenAIChatModel("x", provider=OpenAIProvider(base_url=qwen.url + "/v1", api_key="x"))
    agent = Agent(model, output_type=Report, model_settings={"max_tokens": N}, instructions="Use the tools.")
    ran = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        ran.append(city)
        return json.dumps(WEATHER)

    out = agent.run_sync("What is the weather in Paris right now?").output
    assert ran and isinstance(out, Report) and isinstance(out.weather, Weather)


def test_the_openai_agents_sdk_runs_its_tool_over_the_responses_api(qwen):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    ran = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        ran.append(city)
        return json.dumps(WEATHER)

    model = agents.OpenAIResponsesModel(model="x", openai_client=openai.AsyncOpenAI(
        base_url=qwen.url + "/v1", api_key="x", max_retries=0, timeout=600))
    agent = agents.Agent(name="weather", instructions="Answer with the tools.", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(max_tokens=N))
    out = agents.Runner.run_sync(agent, QUESTION, max_turns=4).final_output
    assert ran and used_result(out), out
