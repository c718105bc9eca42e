"""Client JSON nested deeper than the server reads: tool-call arguments (a JSON text inside the request), tool
parameters and response formats. Each is a 400 with one line in the API's error shape, never a 500 or a
traceback; what the model writes nested too deeply is content, not a call."""

from __future__ import annotations

import json

import pytest

from helpers import post
from localspec.server.tool_calls import parse

DEEP = 5000
USER = {"role": "user", "content": "Weather?"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def nested(depth: int, leaf=1):
    """A JSON value `depth` levels deep: {"a": {"a": ... leaf}} (built without recursion)."""
    v = leaf
    for _ in range(depth):
        v = {"a": v}
    return v


def deep_text(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


def deep_schema(depth: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}}
    return s


def one_line_400(status, err, param):
    assert status == 400, err
    e = err["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["type"] == "invalid_request_error", err
    assert e["param"] == param and "\n" not in e["message"] and "Traceback" not in e["message"], err
    assert len(e["message"]) < 300, err
    return e["message"]


def history(arguments) -> list[dict]:
    return [USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                                          "function": {"name": "get_weather",
                                                                                       "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]


@pytest.mark.parametrize("arguments", [deep_text(DEEP), deep_text(300), nested(300)],
                         ids=["text 5000 deep", "text 300 deep", "object 300 deep"])
def test_deep_arguments_in_a_chat_history_are_a_400(open_api, arguments):
    status, _, err = post(open_api, "/v1/chat/completions", {"messages": history(arguments), "tools": TOOLS,
                                                             "max_tokens": 2})
    msg = one_line_400(status, err, "messages")
    assert "messages[1].tool_calls[0].function.arguments" in msg or "messages" in msg, msg


@pytest.mark.parametrize("arguments", [deep_text(DEEP), deep_text(300)])
def test_deep_arguments_of_a_function_call_item_are_a_400(open_api, arguments):
    body = {"tools": [{"type": "function", "name": "get_weather"}], "max_output_tokens": 2, "input": [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"}]}
    status, _, err = post(open_api, "/v1/responses", body)
    assert "input[1]" in one_line_400(status, err, "input")


def test_json_nested_up_to_the_bound_is_read(open_api):
    """At the bound every walk over the request (the template, schemas, the prompt's plain text) still runs."""
    from localspec.server.openai import MAX_DEPTH

    for arguments in (deep_text(20), deep_text(MAX_DEPTH), nested(MAX_DEPTH - 7)):
        status, _, body = post(open_api, "/v1/chat/completions", {"messages": history(arguments), "tools": TOOLS,
                                                                  "max_tokens": 2})
        assert status == 200, body
    schema = deep_schema((MAX_DEPTH - 5) // 2)
    for choice in ("auto", "required"):
        status, _, body = post(open_api, "/v1/chat/completions", {"messages": [USER], "max_tokens": 2, "tools": [
            {"type": "function", "function": {"name": "f", "parameters": schema}}], "tool_choice": choice})
        assert status in (200, 400) and "internal" not in json.dumps(body), body
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": deep_schema((MAX_DEPTH - 5) // 2)}}
    status, _, body = post(open_api, "/v1/chat/completions", {"messages": [USER], "max_tokens": 2,
                                                              "response_format": fmt})
    assert status in (200, 400) and "internal" not in json.dumps(body), body


@pytest.mark.parametrize("where", ["tools", "response_format"])
def test_deep_schemas_are_a_400(open_api, where):
    schema = deep_schema(400)
    body = {"messages": [USER], "max_tokens": 2}
    if where == "tools":
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        body["tool_choice"] = "required"
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}
    status, _, err = post(open_api, "/v1/chat/completions", body)
    one_line_400(status, err, where)


def test_a_deep_body_is_a_400(open_api):
    status, _, err = post(open_api, "/v1/chat/completions", '{"messages": [' + "[" * DEEP + "]" * DEEP + "]}")
    assert status == 400 and "\n" not in err["error"]["message"], err


def test_what_the_model_writes_nested_too_deeply_is_content():
    for text in ('{"name": "get_weather", "arguments": ' + deep_text(DEEP) + "}",
                 '{"name": "get_weather", "arguments": ' + deep_text(300) + "}",
                 "[" * DEEP, '<tool_call>{"name": "get_weather", "arguments": ' + deep_text(DEEP) + "}</tool_call>"):
        assert parse(text, {"get_weather"}) == (text, [])
