"""Tool calls through `localspec serve` on real models, as the model writes them: a forced answer cut by the token
limit (SmolLM2-135M, `$defs` parameters), and the second turn of a tool loop on the default target
(Qwen2.5-Coder-1.5B), which echoes the call it made instead of answering (the turn is then generated again without
tools). Skipped when the models are absent."""

from __future__ import annotations

import json

import pytest

from conftest import REAL_MODELS
from helpers import loaded_session, serving
from test_server_tool_choice import UNITS, check_defs_call, defs_tools

QWEN = REAL_MODELS / "qwen2.5-coder-1.5b-instruct.gguf"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def served(path, tmp_path_factory):
    from localspec.server.config import ServerConfig

    with loaded_session({"model": str(path), "ctx_size": 2048, "threads": 2, "temperature": 0.0},
                        tmp_path_factory.mktemp("cfg")) as sess:
        with serving(sess, ServerConfig()) as s:
            yield s


@pytest.fixture(scope="module")
def smol(smollm_path, tmp_path_factory):
    yield from served(smollm_path, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    if not QWEN.is_file():
        pytest.skip(f"real model absent: {QWEN} (run ../shared/models/fetch-real-models.sh)")
    yield from served(QWEN, tmp_path_factory)


def test_a_forced_answer_cut_by_the_token_limit_keeps_its_whole_calls(smol):
    c = smol.client(max_retries=0, timeout=600)
    kw = dict(model="x", messages=[{"role": "user", "content": "Log the temperature 21 celsius and the wind speed "
                                                               "12 knots."}],
              tools=defs_tools("$defs"), tool_choice="required", temperature=0)
    whole = c.chat.completions.create(max_tokens=200, **kw).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 2, whole
    cut = c.chat.completions.create(max_tokens=60, **kw).choices[0]  # ends inside the second call
    assert cut.finish_reason == "length" and cut.message.content is None, cut
    assert [t.model_dump() for t in cut.message.tool_calls] == \
        [{**whole.message.tool_calls[0].model_dump(), "id": cut.message.tool_calls[0].id}]
    one = c.chat.completions.create(max_tokens=200, parallel_tool_calls=False, **kw).choices[0]
    assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1, one
    call = one.message.tool_calls[0].function
    assert call.name in UNITS
    check_defs_call(call.name, json.loads(call.arguments))


def test_the_second_turn_of_a_tool_loop_answers_instead_of_calling_again(qwen):
    c = qwen.client(max_retries=0, timeout=900)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = c.chat.completions.create(model="x", messages=msgs, tools=[WEATHER_TOOL], tool_choice="auto",
                                      max_tokens=60).choices[0]
    assert first.finish_reason == "tool_calls", first
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    msgs += [first.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 31, "sky": "clear"})}]
    r = c.chat.completions.create(model="x", messages=msgs, tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=60)
    second = r.choices[0]
    # the model echoes its call: that answer is generated again without tools, and says what the result holds
    assert second.finish_reason == "stop" and not second.message.tool_calls, second
    assert "31" in second.message.content, second
    assert r.model_extra["localspec"]["retried"], r
