"""`POST /v1/responses` as the official `openai` client uses it: text in, text out, instructions, streaming events;
the text is the same as the chat endpoint's for the same messages."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from test_server_hardening import open_api, session  # noqa: E402,F401  (fixtures)


def test_responses_create_text_and_instructions(open_api):
    c = open_api.client(max_retries=0)
    r = c.responses.create(model="gpt-4o-mini", input="Say hi", instructions="Be brief.", max_output_tokens=6,
                           temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == open_api.app.state.model
    assert r.status in ("completed", "incomplete") and r.output[0].type == "message"
    assert r.output[0].role == "assistant" and r.output_text == r.output[0].content[0].text
    assert 0 < r.usage.output_tokens <= 6 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    chat = c.chat.completions.create(model="x", max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}])
    assert chat.choices[0].message.content == r.output_text  # the same prompt and decoding
    assert r.model_extra["localspec"]["k_requested"] >= 0


def test_responses_input_as_messages(open_api):
    c = open_api.client(max_retries=0)
    r = c.responses.create(model="x", max_output_tokens=4, temperature=0, input=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Say hi"}]}])
    chat = c.chat.completions.create(model="x", max_tokens=4, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}])
    assert r.output_text == chat.choices[0].message.content


def test_responses_stream_events(open_api):
    c = open_api.client(max_retries=0)
    events = list(c.responses.create(model="x", input="Count", instructions="Be brief.", max_output_tokens=8,
                                     temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds and "response.output_text.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text == events[-1].response.output_text
    whole = c.responses.create(model="x", input="Count", instructions="Be brief.", max_output_tokens=8, temperature=0)
    assert whole.output_text == text


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "temperature": 3}, "temperature"),
])
def test_bad_responses_requests_are_400(open_api, body, param):
    status, _, err = open_api.raw("POST", "/v1/responses", json.dumps(body))
    assert status == 400 and err["error"]["param"] == param, err


@pytest.mark.parametrize("value", [0, -1])
def test_a_max_output_tokens_below_one_names_max_output_tokens(open_api, value):
    status, _, err = open_api.raw("POST", "/v1/responses", json.dumps({"input": "hi", "max_output_tokens": value}))
    assert status == 400 and err["error"]["param"] == "max_output_tokens", err
    message = err["error"]["message"]
    assert "max_output_tokens" in message and "max_tokens" not in message.replace("max_output_tokens", ""), message
    assert str(value) in message
