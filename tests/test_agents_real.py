"""Agent clients against `localspec serve` on the default pair (Qwen2.5-Coder-1.5B + 0.5B): tool loops with
tool_choice auto as the model really writes its calls (a fenced, indented JSON block), strict JSON schemas, the
Responses API and the agent libraries' own loops (the checks of benchmarks/agents/clients.py). Skipped when the
models are absent; a client whose package is not installed is skipped (CI installs only openai)."""

from __future__ import annotations

import json

import pytest

from benchmarks.agents import clients
from benchmarks.agents.clients import QUESTION, WEATHER, used_result
from conftest import REAL_MODELS
from helpers import loaded_session, serving

TARGET = REAL_MODELS / "qwen2.5-coder-1.5b-instruct.gguf"
DRAFT = REAL_MODELS / "qwen2.5-coder-0.5b-instruct.gguf"
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
N = 160  # max tokens per answer


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    for p in (TARGET, DRAFT):
        if not p.is_file():
            pytest.skip(f"real model absent: {p} (run ../shared/models/fetch-real-models.sh)")
    from localspec.server.config import ServerConfig

    with loaded_session({"model": str(TARGET), "draft": str(DRAFT), "ctx_size": 4096, "threads": 2,
                         "temperature": 0.0, "max_tokens": N}, tmp_path_factory.mktemp("cfg")) as sess:
        with serving(sess, ServerConfig()) as s:
            yield s


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


def test_llm_runs_a_python_function_tool_and_a_schema(qwen):
    """`llm -T` / `--functions`: the tool runs and its result reaches the answer; `llm --schema` gives the keys."""
    pytest.importorskip("llm")
    got = clients.check_llm(qwen.url + "/v1", N)
    for part, (ok, detail) in got.items():
        assert ok, (part, detail)


def test_a_pydantic_ai_agent_with_a_nested_output_type_and_a_tool_completes(qwen):
    pytest.importorskip("pydantic_ai")
    ok, detail = clients.check_pydantic_ai(qwen.url + "/v1", N)
    assert ok, detail


def test_the_openai_agents_sdk_runs_its_tool_over_the_responses_api(qwen):
    pytest.importorskip("agents")
    ok, detail = clients.check_agents_sdk(qwen.url + "/v1", N)
    assert ok, detail
