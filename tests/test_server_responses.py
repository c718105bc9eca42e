"""`POST /v1/responses` as the official `openai` client uses it: text in, text out, instructions, streaming events;
the text is the same as the chat endpoint's for the same messages."""

from __future__ import annotations

import json

import openai
import pytest

from helpers import WRITTEN, Scripted, accepts

# a function tool as the Responses API (and the Agents SDK) sends it: flat, not under "function"
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"], "additionalProperties": False}}


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
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "arguments": "{}"}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0]"),
    ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}}}}, "text.format"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "n": 2}, "n"),
    ({"input": "hi", "n": 2, "stream": True}, "n"),
    ({"input": "hi", "n": 0}, "n"),
])
def test_bad_responses_requests_are_400(open_api, body, param):
    status, _, err = open_api.raw("POST", "/v1/responses", json.dumps(body))
    assert status == 400 and err["error"]["param"] == param, err


def test_n_is_refused_with_one_line_and_n_1_is_served(open_api):
    """The Responses API has no n (a response holds one answer): n other than 1 is a 400 naming n that says where
    several answers come from, never a 500; n 1 asks for what the API gives anyway."""
    status, _, err = open_api.raw("POST", "/v1/responses", json.dumps({"input": "hi", "n": 3, "max_output_tokens": 2}))
    assert status == 400 and err["error"]["param"] == "n" and err["error"]["type"] == "invalid_request_error", err
    assert "/v1/chat/completions" in err["error"]["message"] and "\n" not in err["error"]["message"]
    status, _, body = open_api.raw("POST", "/v1/responses", json.dumps({"input": "hi", "n": 1, "max_output_tokens": 2}))
    assert status == 200 and body["object"] == "response" and body["output"][0]["type"] == "message", body


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/chat/completions"])
@pytest.mark.parametrize("method,words", [("eagle3", "an EAGLE-3 draft head"), ("dflash", "a DFlash draft head")])
def test_a_method_whose_head_is_not_loaded_is_a_400_that_reads_as_a_sentence(open_api, path, method, words):
    """The server names what is missing in its own words: no draft head is loaded here, and no flag can give one."""
    body = {"input": "hi"} if path == "/v1/responses" else {"messages": [{"role": "user", "content": "hi"}]}
    status, _, err = open_api.raw("POST", path, json.dumps({**body, "localspec": {"method": method}}))
    assert status == 400 and err["error"]["param"] == "localspec.method", err
    assert err["error"]["message"] == (f"localspec.method {method} needs {words} (none is loaded on this "
                                       "server)"), err


@pytest.mark.parametrize("value", [0, -1])
def test_a_max_output_tokens_below_one_names_max_output_tokens(open_api, value):
    status, _, err = open_api.raw("POST", "/v1/responses", json.dumps({"input": "hi", "max_output_tokens": value}))
    assert status == 400 and err["error"]["param"] == "max_output_tokens", err
    message = err["error"]["message"]
    assert "max_output_tokens" in message and "max_tokens" not in message.replace("max_output_tokens", ""), message
    assert str(value) in message


# ----------------------------------------------------------------- function tools
def test_a_call_comes_back_as_a_function_call_item_and_its_output_goes_back_in(open_api, monkeypatch):
    sc = Scripted(monkeypatch, open_api.session.engine, [WRITTEN["fenced"], "It is sunny in Paris."])
    c = open_api.client(max_retries=0)
    r = c.responses.create(model="x", input="Weather in Paris?", instructions="Use the tools.", tools=[TOOL])
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    assert r.tools[0].name == "get_weather" and r.tool_choice == "auto"
    assert '"name": "get_weather"' in sc.prompts[0]  # the tools reached the template

    r2 = c.responses.create(model="x", tools=[TOOL], instructions="Use the tools.", input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "id": call.id, "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments, "status": "completed"},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}])
    assert r2.output_text == "It is sunny in Paris." and [o.type for o in r2.output] == ["message"]
    second = sc.prompts[-1]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in second
    assert '<tool_response>\n{"sky": "sunny"}\n</tool_response>' in second


def test_a_streamed_call_is_a_function_call_item_with_its_arguments_in_pieces(open_api, monkeypatch):
    Scripted(monkeypatch, open_api.session.engine, ["Let me look.\n" + WRITTEN["bare"]] * 2)
    c = open_api.client(max_retries=0)
    whole = c.responses.create(model="x", input="Weather in Paris?", tools=[TOOL])
    events = list(c.responses.create(model="x", input="Weather in Paris?", tools=[TOOL], stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Let me look." == whole.output[0].content[0].text
    args = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(args) > 1 and json.loads("".join(e.delta for e in args)) == {"city": "Paris"}
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [a.type for a in added] == ["message", "function_call"] and added[1].arguments == ""
    final = events[-1].response
    assert [o.type for o in final.output] == [o.type for o in whole.output] == ["message", "function_call"]
    assert final.output[1].arguments == done.arguments == whole.output[1].arguments
    assert final.output[1].call_id == added[1].call_id and args[0].item_id == final.output[1].id


def test_a_named_function_is_forced_with_speculation_and_its_schema(open_api):
    c = open_api.client(max_retries=0)
    r = c.responses.create(model="x", input="the cat", tools=[TOOL], temperature=0, max_output_tokens=200,
                           tool_choice={"type": "function", "name": "get_weather"},
                           extra_body={"localspec": {"method": "draft"}})
    assert [o.type for o in r.output] == ["function_call"], (r.status, r.output)
    call = r.output[0]
    assert call.name == "get_weather"
    args = json.loads(call.arguments)
    assert set(args) == {"city"} and len(args["city"]) <= 12
    assert r.model_extra["localspec"]["drafted"] > 0


def test_text_format_json_schema_constrains_the_answer(open_api):
    c = open_api.client(max_retries=0)
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["colour", "n"]}
    fmt = {"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}}
    r = c.responses.create(model="x", input="the cat", temperature=0, max_output_tokens=60, text=fmt)
    obj = json.loads(r.output_text)
    assert set(obj) == {"colour", "n"} and obj["colour"] in ("red", "blue") and isinstance(obj["n"], int)
    assert r.text.format.type == "json_schema"
    free = c.responses.create(model="x", input="the cat", temperature=0, max_output_tokens=60)
    assert free.output_text != r.output_text
    obj = c.responses.create(model="x", input="the cat", temperature=0, max_output_tokens=60,
                             text={"format": {"type": "json_object"}}).output_text
    assert obj.startswith("{")  # an object (60 tokens may cut a long one)


def test_tools_with_text_format_take_a_call_or_the_schemas_json(open_api, monkeypatch):
    """The Agents SDK with an output type sends both: the answer is either a call or the final JSON."""
    from localspec.server.grammar import Grammar, Lazy

    sc = Scripted(monkeypatch, open_api.session.engine, [WRITTEN["hermes"]])
    c = open_api.client(max_retries=0)
    fmt = {"format": {"type": "json_schema", "name": "out", "schema": {
        "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}
    r = c.responses.create(model="x", input="Weather?", tools=[TOOL], text=fmt)
    assert r.output[0].type == "function_call"
    (con,) = sc.constraints
    assert isinstance(con, Grammar) and not isinstance(con, Lazy)
    assert accepts(con.grammar, '{"answer": "sunny"}') and accepts(con.grammar, WRITTEN["fenced"])
    assert not accepts(con.grammar, "It is sunny.") and not accepts(con.grammar, '{"answer": "x", "more": 1}')


@pytest.mark.parametrize("streamed", [False, True])
def test_the_agents_sdk_runs_a_function_tool(open_api, monkeypatch, streamed):
    """The OpenAI Agents SDK's own loop (Responses API): the model's call runs the Python function, its output
    goes back, and the final answer ends the run."""
    agents = pytest.importorskip("agents")
    import asyncio

    sc = Scripted(monkeypatch, open_api.session.engine, [WRITTEN["fenced"], "It is sunny in Paris."])
    agents.set_tracing_disabled(True)
    ran = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        ran.append(city)
        return "sunny"

    model = agents.OpenAIResponsesModel(model="x", openai_client=openai.AsyncOpenAI(
        base_url=open_api.url + "/v1", api_key="unused", max_retries=0))
    agent = agents.Agent(name="w", instructions="Use the tools.", tools=[get_weather], model=model)
    if streamed:
        async def go():
            run = agents.Runner.run_streamed(agent, "Weather in Paris?")
            async for _ in run.stream_events():
                pass
            return run.final_output
        out = asyncio.run(go())
    else:
        out = agents.Runner.run_sync(agent, "Weather in Paris?").final_output
    assert ran == ["Paris"] and out == "It is sunny in Paris."
    assert "<tool_response>\nsunny\n</tool_response>" in sc.prompts[-1]
