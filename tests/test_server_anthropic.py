"""`POST /v1/messages` (Anthropic's Messages API) as the official `anthropic` client uses it: text, system blocks,
streamed events that add up to the answer, forced and streamed `tool_use` blocks, `tool_result` turns,
count_tokens, errors in Anthropic's shape with its status codes, the API key as `x-api-key`; and a two-turn tool
loop on Qwen2.5-Coder-1.5B (skipped when absent)."""

from __future__ import annotations

import http.client
import json

import pytest

from conftest import REAL_MODELS
from helpers import KEY, WRITTEN, Scripted, accepts, answered_by_generate, loaded_session, post, serving

anthropic = pytest.importorskip("anthropic")

TOOL = {"name": "get_weather", "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                         "required": ["city"], "additionalProperties": False}}
USER = [{"role": "user", "content": "Say hi"}]


def client(s, **kw):
    return anthropic.Anthropic(base_url=s.url, api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


def events(s, body: dict, **headers) -> list[tuple[str, dict]]:
    """The (event name, data) pairs of a streamed POST /v1/messages, as sent."""
    conn = http.client.HTTPConnection(s.host, int(s.port), timeout=60)
    try:
        conn.request("POST", "/v1/messages", body=json.dumps({**body, "stream": True}),
                     headers={"Content-Type": "application/json", **headers})
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
        out = []
        for block in r.read().decode().split("\n\n"):
            if block.strip():
                lines = dict(line.split(": ", 1) for line in block.splitlines())
                data = json.loads(lines["data"])
                assert data["type"] == lines["event"]
                out.append((lines["event"], data))
        return out
    finally:
        conn.close()


def test_text_answer_and_its_usage(open_api):
    c = client(open_api)
    m = c.messages.create(model="claude-sonnet-4-5", max_tokens=6, system="Be brief.", messages=USER)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == open_api.app.state.model  # any name is served by the loaded pair
    assert [b.type for b in m.content] == ["text"] and m.stop_reason in ("end_turn", "max_tokens")
    assert 0 < m.usage.output_tokens <= 6 and m.usage.cache_creation_input_tokens == 0
    chat = open_api.client(max_retries=0).chat.completions.create(
        model="x", max_tokens=6,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}])
    assert m.content[0].text == chat.choices[0].message.content  # the same prompt and decoding
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert m.model_extra["localspec"]["k_requested"] >= 0 and "tokens_per_second" in m.model_extra["localspec"]
    if m.stop_reason == "max_tokens":
        assert m.usage.output_tokens == 6


def test_system_blocks_with_cache_control_are_the_system_prompt(open_api):
    c = client(open_api)
    blocks = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Answer in English.",
                                                       "cache_control": {"type": "ephemeral"}}]
    a = c.messages.create(model="x", max_tokens=5, system=blocks, messages=USER)
    b = c.messages.create(model="x", max_tokens=5, system="Be brief.\nAnswer in English.",
                          messages=USER)
    assert a.content[0].text == b.content[0].text
    assert c.messages.count_tokens(model="x", system=blocks, messages=USER).input_tokens == \
        c.messages.count_tokens(model="x", system="Be brief.\nAnswer in English.", messages=USER).input_tokens


def test_a_reused_prompt_is_a_cache_read(open_api):
    c = client(open_api)
    msgs = [{"role": "user", "content": "the cat and the dog " * 20}]
    first = c.messages.create(model="x", max_tokens=3, messages=msgs)
    again = c.messages.create(model="x", max_tokens=3, messages=msgs)
    total = c.messages.count_tokens(model="x", messages=msgs).input_tokens
    for m in (first, again):
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == total
    assert again.usage.cache_read_input_tokens > 0


def test_claude_codes_billing_line_does_not_break_the_reused_prompt(open_api):
    """Claude Code opens `system` with an `x-anthropic-billing-header: ...; cch=XXXXX;` block whose hash changes with
    every request: it is dropped, so the system prompt and tools after it are reused from the cache."""
    c = client(open_api)
    long = "You are a careful assistant. " * 30
    def ask(cch: str):
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{cch[:3]}; "
                                           f"cc_entrypoint=cli; cch={cch};"},
                  {"type": "text", "text": long, "cache_control": {"type": "ephemeral"}}]
        return c.messages.create(model="x", max_tokens=2, system=system, messages=USER)
    first, second = ask("36ee5"), ask("0aaa9")
    plain = c.messages.count_tokens(model="x", system=long, messages=USER).input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == plain  # the line is not in the prompt
    assert second.usage.cache_read_input_tokens >= plain - 8  # all but the last few tokens reused
    assert second.content[0].text == first.content[0].text


def test_the_stream_helper_adds_up_to_the_whole_answer(open_api):
    c = client(open_api)
    kw = dict(model="x", max_tokens=8, system="Be brief.", messages=[{"role": "user",
                                                                                    "content": "Count"}])
    whole = c.messages.create(**kw)
    with c.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens or final.usage.cache_read_input_tokens > 0


def test_raw_events_come_in_anthropics_order(open_api):
    evs = events(open_api, {"model": "x", "max_tokens": 8, "messages": USER},
                 **{"anthropic-version": "2023-06-01", "anthropic-beta": "prompt-caching-2024-07-31"})
    kinds = [k for k, _ in evs if k != "ping"]
    assert "ping" in [k for k, _ in evs]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    start = evs[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    text = "".join(d["delta"]["text"] for k, d in evs if k == "content_block_delta")
    assert all(d["delta"]["type"] == "text_delta" and d["index"] == 0 for k, d in evs if k == "content_block_delta")
    delta = next(d for k, d in evs if k == "message_delta")
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens") and delta["usage"]["output_tokens"] > 0
    assert delta["localspec"]["drafted"] >= 0
    whole = client(open_api).messages.create(model="x", max_tokens=8, messages=USER)
    assert text == whole.content[0].text


def test_top_k_1_is_greedy(open_api):
    c = client(open_api)
    greedy = c.messages.create(model="x", max_tokens=8, messages=USER).content[0].text  # the server's default
    top1 = c.messages.create(model="x", max_tokens=8, messages=USER,
                             extra_body={"temperature": 1, "top_k": 1}).content[0].text
    assert top1 == greedy


def test_a_stop_sequence_ends_the_answer_and_is_named(open_api):
    c = client(open_api)
    free = c.messages.create(model="x", max_tokens=24, messages=USER).content[0].text
    at = next(i for i in range(2, len(free) - 2) if free.find(free[i:i + 2]) == i and free[i:i + 2].strip())
    stop = free[at:at + 2]
    m = c.messages.create(model="x", max_tokens=24, messages=USER, stop_sequences=["\x00", stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop, (free, stop, m)
    assert m.content[0].text == free[:at]


# ----------------------------------------------------------------- tools
def test_a_forced_tool_gives_a_tool_use_block_with_an_object_input(open_api):
    c = client(open_api)
    m = c.messages.create(model="x", max_tokens=200, tools=[TOOL], messages=[
        {"role": "user", "content": "Weather in Paris?"}], tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"localspec": {"method": "draft"}})
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"], m
    use = m.content[0]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    assert isinstance(use.input, dict) and set(use.input) == {"city"} and len(use.input["city"]) <= 12
    assert m.model_extra["localspec"]["drafted"] > 0


def test_a_tool_result_turn_reaches_the_template(open_api, monkeypatch):
    sc = Scripted(monkeypatch, open_api.session.engine, [WRITTEN["hermes"], "It is sunny in Paris."])
    c = client(open_api)
    first = c.messages.create(model="x", max_tokens=100, system="Use the tools.", tools=[TOOL],
                              messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"]
    use = first.content[0]
    assert use.input == {"city": "Paris"} and '"name": "get_weather"' in sc.prompts[0]
    second = c.messages.create(model="x", max_tokens=100, system="Use the tools.", tools=[TOOL], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Call it.", "signature": "x"},
                                          {"type": "text", "text": "Let me look."}, use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": [{"type": "text", "text": '{"sky": "sunny"}'}]},
                                     {"type": "text", "text": "Be brief."}]}])
    assert second.stop_reason == "end_turn" and second.content[0].text == "It is sunny in Paris."
    prompt = sc.prompts[-1]
    assert 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"sky": "sunny"}\n</tool_response>' in prompt and "Call it." not in prompt
    assert prompt.index("</tool_response>") < prompt.index("Be brief.")


def test_system_messages_among_the_turns(open_api, monkeypatch):
    """A system message before the first turn joins the system prompt; a later one is user text at its place
    (Claude Code sends one after its first user turn), and consecutive user turns are one turn."""
    sc = Scripted(monkeypatch, open_api.session.engine, ["Hi."] * 2)
    c = client(open_api)
    c.messages.create(model="x", max_tokens=10, system="Be brief.", messages=[
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "say hi"},
        {"role": "system", "content": [{"type": "text", "text": "Agents: none."}]}])
    c.messages.create(model="x", max_tokens=10, messages=[{"role": "user", "content": "say hi"},
                                                          {"role": "user", "content": "now"}])
    first, second = sc.prompts
    assert "<|im_start|>system\nBe brief.\n\nBe kind.<|im_end|>" in first, first
    assert "<|im_start|>user\nsay hi\n\nAgents: none.<|im_end|>" in first, first
    assert "<|im_start|>user\nsay hi\n\nnow<|im_end|>" in second, second


def test_a_failed_tool_says_so_and_a_result_may_be_a_string(open_api, monkeypatch):
    sc = Scripted(monkeypatch, open_api.session.engine, ["Sorry."])
    client(open_api).messages.create(model="x", max_tokens=10, tools=[TOOL], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oz"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": "no such city"}]}])
    assert "<tool_response>\nError: no such city\n</tool_response>" in sc.prompts[-1]


def test_a_streamed_call_is_a_tool_use_block_with_its_input_in_pieces(open_api, monkeypatch):
    Scripted(monkeypatch, open_api.session.engine, ["Let me look.\n" + WRITTEN["bare"]] * 2)
    body = {"model": "x", "max_tokens": 100, "tools": [TOOL], "messages": [{"role": "user", "content": "Weather?"}]}
    evs = events(open_api, body)
    starts = [d["content_block"] for k, d in evs if k == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use"] and starts[1]["input"] == {}
    assert starts[1]["id"].startswith("toolu_") and starts[1]["name"] == "get_weather"
    pieces = [d["delta"]["partial_json"] for k, d in evs if k == "content_block_delta" and d["index"] == 1]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"city": "Paris"}
    text = "".join(d["delta"]["text"] for k, d in evs if k == "content_block_delta" and d["index"] == 0)
    assert text == "Let me look."
    assert [k for k, _ in evs if k == "content_block_stop"] == ["content_block_stop"] * 2
    assert next(d for k, d in evs if k == "message_delta")["delta"]["stop_reason"] == "tool_use"
    with client(open_api).messages.stream(**body) as s:  # the SDK puts the pieces together
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.content[1].input == {"city": "Paris"}


def test_keywords_the_grammar_cannot_enforce_are_left_out(open_api, monkeypatch):
    """Claude Code's tools use `propertyNames`, which llguidance does not implement: the input is held to the rest
    of the schema (a property of that name stays), where chat answers a 400."""
    tool = {"name": "tag", "input_schema": {"type": "object", "required": ["propertyNames"], "properties": {
        "propertyNames": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"},
                          "additionalProperties": {"type": "integer"}}}}}
    call = '<tool_call>\n{"name": "tag", "arguments": {"propertyNames": {"a": 1}}}\n</tool_call>'
    sc = Scripted(monkeypatch, open_api.session.engine, [call])
    m = client(open_api).messages.create(model="x", max_tokens=200, tools=[tool], messages=USER,
                                         tool_choice={"type": "tool", "name": "tag"})
    assert m.stop_reason == "tool_use" and m.content[0].input == {"propertyNames": {"a": 1}}, m
    (con,) = sc.constraints
    body = '{"name": "tag", "arguments": {"propertyNames": {"a": 1}}}'  # the grammar's format for this template
    assert accepts(con.grammar, body) and not accepts(con.grammar, body.replace("1}", '"x"}'))
    status, _, err = post(open_api, "/v1/chat/completions", {"max_tokens": 5, "messages": USER, "tools": [
        {"type": "function", "function": {"name": "tag", "parameters": tool["input_schema"]}}]})
    assert status == 400 and "propertyNames" in err["error"]["message"], err


@pytest.mark.parametrize("choice,forced", [({"type": "any"}, True), ({"type": "auto"}, False)])
def test_tool_choice_any_forces_a_call(open_api, monkeypatch, choice, forced):
    from localspec.server.grammar import Grammar, Lazy

    assert not issubclass(Lazy, Grammar)
    sc = Scripted(monkeypatch, open_api.session.engine, [WRITTEN["hermes"]])
    m = client(open_api).messages.create(model="x", max_tokens=100, tools=[TOOL], tool_choice=choice,
                                         messages=[{"role": "user", "content": "Weather?"}])
    assert m.stop_reason == "tool_use"
    (con,) = sc.constraints
    assert isinstance(con, Lazy if not forced else Grammar)


def test_disable_parallel_tool_use_gives_one_call(open_api, monkeypatch):
    two = WRITTEN["hermes"] + "\n" + WRITTEN["hermes"].replace("Paris", "Rome")
    Scripted(monkeypatch, open_api.session.engine, [two, two])
    c = client(open_api)
    kw = dict(model="x", max_tokens=100, tools=[TOOL], messages=[{"role": "user", "content": "Weather?"}])
    assert [b.input["city"] for b in c.messages.create(**kw).content] == ["Paris", "Rome"]
    one = c.messages.create(tool_choice={"type": "auto", "disable_parallel_tool_use": True}, **kw)
    assert [b.input["city"] for b in one.content] == ["Paris"]


def test_tool_choice_none_gives_text(open_api, monkeypatch):
    sc = Scripted(monkeypatch, open_api.session.engine, [WRITTEN["hermes"]])
    m = client(open_api).messages.create(model="x", max_tokens=100, tools=[TOOL], tool_choice={"type": "none"},
                                         messages=[{"role": "user", "content": "Weather?"}])
    assert m.stop_reason == "end_turn" and m.content[0].text == WRITTEN["hermes"]
    assert '"name": "get_weather"' not in sc.prompts[0]


def test_output_config_format_constrains_the_answer(open_api):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["colour", "n"]}
    c = client(open_api)
    kw = dict(model="x", max_tokens=60, messages=[{"role": "user", "content": "the cat"}])
    m = c.messages.create(extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}}, **kw)
    obj = json.loads(m.content[0].text)
    assert set(obj) == {"colour", "n"} and obj["colour"] in ("red", "blue") and isinstance(obj["n"], int)
    assert c.messages.create(**kw).content[0].text != m.content[0].text


# ----------------------------------------------------------------- count_tokens
def test_count_tokens_counts_the_prompt_with_its_tools(open_api):
    c = client(open_api)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    plain = c.messages.count_tokens(model="x", messages=msgs).input_tokens
    with_tools = c.messages.count_tokens(model="x", messages=msgs, tools=[TOOL]).input_tokens
    assert 0 < plain < with_tools
    m = c.messages.create(model="x", max_tokens=2, messages=msgs)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == plain


# ----------------------------------------------------------------- errors
def anthropic_error(status, body, want_status, want_type):
    assert status == want_status, body
    assert body["type"] == "error" and body["error"]["type"] == want_type, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["request_id"]


@pytest.mark.parametrize("body,words", [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 0, "messages": USER}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "tool", "content": "hi"}]}, "role"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": USER, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 5, "messages": USER, "top_k": -1}, "top_k"),
    ({"max_tokens": 5, "messages": USER, "stop_sequences": "x"}, "stop_sequences"),
    ({"max_tokens": 5, "messages": USER, "stop_sequences": ["x"] * 17}, "stop_sequences"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "image"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}, "document"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}]}]}, "image"),
    ({"max_tokens": 5, "messages": USER, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0]"),
    ({"max_tokens": 5, "messages": USER, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice"),
    ({"max_tokens": 5, "messages": USER, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 5, "messages": USER, "localspec": {"method": "nope"}}, "localspec.method"),
    ({"max_tokens": 5, "messages": USER, "output_config": {"format": {"type": "json_schema"}}},
     "output_config.format"),
])
def test_bad_requests_are_anthropic_400s(open_api, body, words):
    status, _, err = post(open_api, "/v1/messages", body)
    anthropic_error(status, err, 400, "invalid_request_error")
    assert words in err["error"]["message"], err


def test_the_sdk_raises_its_own_errors(open_api):
    c = client(open_api)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="x", max_tokens=5, messages=[{"role": "tool", "content": "x"}])
    assert e.value.status_code == 400 and e.value.body["error"]["type"] == "invalid_request_error"


def test_unknown_fields_and_model_names_are_served(open_api):
    status, _, body = post(open_api, "/v1/messages", {
        "model": "claude-opus-4-1-20250805", "max_tokens": 3, "messages": USER, "metadata": {"user_id": "u"},
        "thinking": {"type": "disabled"}, "service_tier": "auto", "context_management": {"edits": []}})
    assert status == 200 and body["type"] == "message" and body["model"] == open_api.app.state.model, body


def test_other_refusals_are_in_anthropics_shape(open_api):
    anthropic_error(*post(open_api, "/v1/messages/batches", {"requests": []})[::2], 404, "not_found_error")
    big = {"max_tokens": 5, "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]}
    anthropic_error(*post(open_api, "/v1/messages", big)[::2], 413, "request_too_large")
    status, _, err = post(open_api, "/v1/messages", "{", )
    anthropic_error(status, err, 400, "invalid_request_error")
    status, _, err = post(open_api, "/v1/messages", "{}", **{"Content-Type": "text/plain"})
    anthropic_error(status, err, 400, "invalid_request_error")
    status, _, err = post(open_api, "/v1/chat/completions", {"messages": []})  # other endpoints keep OpenAI's
    assert status == 400 and "type" not in err and err["error"]["param"] == "messages"


def test_a_full_queue_is_overloaded_529():
    from localspec.server.anthropic_errors import reshape

    raw = json.dumps({"error": {"message": "server busy", "type": "server_error", "code": "queue_full"}}).encode()
    assert reshape(503, raw) == (529, {"type": "error", "error": {"type": "overloaded_error",
                                                                   "message": "server busy"}})
    assert reshape(500, b"oops")[1]["error"] == {"type": "api_error", "message": "oops"}


def test_a_failed_generation_is_an_error_event(open_api, monkeypatch):
    def broken(*a, **kw):
        raise RuntimeError("boom")
        yield  # pragma: no cover

    monkeypatch.setattr(open_api.session.engine, "generate", broken)
    answered_by_generate(monkeypatch)
    evs = events(open_api, {"model": "x", "max_tokens": 5, "messages": USER})
    assert evs[0][0] == "message_start" and evs[-1] == ("error", {"type": "error", "error": {
        "type": "api_error", "message": "internal error: RuntimeError"}})
    with pytest.raises(anthropic.APIStatusError):
        with client(open_api).messages.stream(model="x", max_tokens=5, messages=USER) as s:
            s.get_final_message()
    status, _, err = post(open_api, "/v1/messages", {"model": "x", "max_tokens": 5, "messages": USER})
    anthropic_error(status, err, 500, "api_error")


# ----------------------------------------------------------------- the API key
@pytest.fixture(scope="module")
def keyed(session):
    from localspec.server.config import ServerConfig

    with serving(session, ServerConfig(api_key=KEY)) as s:
        yield s


def test_the_key_may_come_as_x_api_key(keyed):
    m = client(keyed, api_key=KEY).messages.create(model="x", max_tokens=2, messages=USER)
    assert m.type == "message"
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(keyed, api_key="wrong").messages.create(model="x", max_tokens=2, messages=USER)
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    status, _, err = post(keyed, "/v1/messages", {"max_tokens": 2, "messages": USER})
    anthropic_error(status, err, 401, "authentication_error")
    assert "x-api-key" in err["error"]["message"]
    status, _, _ = post(keyed, "/v1/messages", {"max_tokens": 2, "messages": USER},
                        Authorization=f"Bearer {KEY}")  # ANTHROPIC_AUTH_TOKEN's form
    assert status == 200
    status, _, _ = post(keyed, "/v1/messages/count_tokens", {"messages": USER}, **{"x-api-key": KEY})
    assert status == 200
    status, _, _ = post(keyed, "/v1/chat/completions", {"messages": USER, "max_tokens": 2}, **{"x-api-key": KEY})
    assert status == 200


# ----------------------------------------------------------------- a real model
QWEN = REAL_MODELS / "qwen2.5-coder-1.5b-instruct.gguf"
WEATHER = {"name": "get_weather", "description": "Current weather for a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from localspec.server.config import ServerConfig

    if not QWEN.is_file():
        pytest.skip(f"real model absent: {QWEN} (run ../shared/models/fetch-real-models.sh)")
    with loaded_session({"model": str(QWEN), "ctx_size": 2048, "threads": 2, "temperature": 0.0},
                        tmp_path_factory.mktemp("cfg")) as sess:
        with serving(sess, ServerConfig()) as s:
            yield s


def test_a_two_turn_tool_loop_ends_with_the_tools_result(qwen):
    """The model calls the tool, gets its result, and answers from it (streamed). The 1.5B model echoes its call
    after a bare result (content, not a call: see docs/serve.md); a line of text beside the result, as a Messages
    API user turn may hold, gets it to answer."""
    c = client(qwen, timeout=900)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = c.messages.create(model="claude-sonnet-4-5", max_tokens=80, tools=[WEATHER], messages=msgs)
    assert first.stop_reason == "tool_use", first
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": json.dumps({"temp_c": 31, "sky": "clear"})},
                                          {"type": "text", "text": "Answer my question from this result."}]}]
    with c.messages.stream(model="claude-sonnet-4-5", max_tokens=80, tools=[WEATHER], messages=msgs) as s:
        second = s.get_final_message()
    assert second.stop_reason == "end_turn" and [b.type for b in second.content] == ["text"], second
    assert "31" in second.content[0].text, second.content[0].text
    assert second.usage.cache_read_input_tokens > 0  # the first turn's prompt is reused
