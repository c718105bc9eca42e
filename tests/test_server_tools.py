"""Tool calling through `localspec serve`, as the official `openai` client does it: tools and the conversation's
calls and results reach the chat template, and the answer is read back into `tool_calls` (Hermes/Qwen, Llama 3.x
JSON, Mistral), streamed as OpenAI streams them. The tiny random models never emit a call, so the round trips use a
scripted generation on the real server and the parser is tested on fixed strings."""

from __future__ import annotations

import http.client
import json
import math

import pytest

from helpers import WRITTEN, Scripted, accepts
from localspec.server.tool_calls import parse
from localspec.server.tool_stream import ToolStream
from tinymodels import TOOL_TEMPLATE

NAMES = {"get_weather", "add"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]

# ------------------------------------------------------------------ the parser, on fixed strings
def one(text):
    content, calls = parse(text, NAMES)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_qwen_calls():
    assert one('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>') == \
        ("", [("get_weather", {"city": "Paris"})])
    assert one('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>') == \
        ("Let me check.", [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})])
    # no closing tag at the end of the answer (a stop token cut it): still the call
    assert one('<tool_call>{"name": "add", "arguments": {"a": 1}}') == ("", [("add", {"a": 1})])


def test_llama3_json_calls():
    assert one('{"name": "get_weather", "parameters": {"city": "Rome"}}') == ("", [("get_weather", {"city": "Rome"})])
    assert one('<|python_tag|>{"type": "function", "name": "add", "parameters": {"a": 2}}; '
               '{"name": "add", "parameters": {"a": 3}}') == ("", [("add", {"a": 2}), ("add", {"a": 3})])


def test_mistral_calls():
    assert one('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": '
               '{"city": "Bern"}}]') == ("", [("add", {"a": 1}), ("get_weather", {"city": "Bern"})])
    assert one('[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}') == ("", [("get_weather", {"city": "Lima"})])


PARIS = ("get_weather", {"city": "Paris"})  # the call in every form of WRITTEN


@pytest.mark.parametrize("form", WRITTEN)
def test_each_written_form_is_a_call(form):
    assert one(WRITTEN[form]) == ("", [PARIS])
    assert one("I will look it up.\n\n" + WRITTEN[form] + "\n") == ("I will look it up.", [PARIS])


def test_two_fenced_calls_and_calls_on_lines():
    two = '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\n\n```json\n' \
          '{"name": "add", "arguments": {"a": 1}}\n```'
    assert one(two) == ("", [PARIS, ("add", {"a": 1})])
    assert one('{"name": "get_weather", "arguments": {"city": "Paris"}}\n{"name": "add", "arguments": {}}') == \
        ("", [PARIS, ("add", {})])
    # a fence that the token limit cut before it closed: the call is whole, so it is one
    assert one('```json\n{"name": "add", "arguments": {"a": 1}}\n') == ("", [("add", {"a": 1})])


@pytest.mark.parametrize("text", [
    "I will use get_weather to look up Paris.",
    "Call `get_weather(city='Paris')` to find out.",
    '```python\nget_weather(city="Paris")\n```',
    '```python\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',  # a code block, not JSON
    '```json\n{"name": "Paris", "population": 2100000}\n```',  # JSON, but no tool's name
    '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\nThat call returns the weather.',
    'Use {"name": "get_weather"} with a city.',
    '{"name": "get_weather", "arguments": ["Paris"]}',  # arguments that are no object
    '{{"name": "get_weather", "arguments": {"city": "Paris"}}',  # unbalanced
    "The answer is {x: 1}.",
])
def test_text_that_mentions_a_function_stays_content(text):
    assert parse(text, NAMES) == (text, [])


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # broken JSON
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not one of the tools
    '{"answer": 42}',  # JSON, but no call
    '[TOOL_CALLS] not json',
    '<tool_call>{"name": "add", "arguments": {}}</tool_call> and then more text',
])
def test_what_is_not_a_call_stays_content(text):
    assert parse(text, NAMES) == (text, [])


@pytest.mark.parametrize("text", [
    'Sure <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
    '  {"name": "add", "parameters": {"a": 1}}',
    "plain answer, no tools used: <tool or [TOOL not a marker",
    '{"not": "a call"} ok',
    *WRITTEN.values(),
    "Let me check.\n" + WRITTEN["fenced"],
    'Code:\n```python\nx = {"a": 1}\n```\nand then ' + WRITTEN["bare"],
    '{"name": "add", "arguments": {"a": 1}} trailing words',
    '{"name": "get_weather", "arguments": {"city": "Paris"}} and then {"name": "add", "arguments": {}}',
    '[1, 2] {"b": {"c": "d"}} ```js\nx\n``` done',
])
def test_the_stream_splitter_gives_the_same_result_piece_by_piece(text):
    for size in (1, 3, 7):
        ts = ToolStream(NAMES)
        sent = "".join(ts.feed(text[i:i + size]) for i in range(0, len(text), size))
        rest, calls = ts.end()
        content, want = parse(text, NAMES)
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want]
        if want:
            assert (sent + rest).strip() == content
        else:
            assert sent + rest == text


def test_the_stream_splitter_passes_on_what_cannot_be_a_call_as_it_comes():
    """Code blocks, JSON that names no tool and prose stream on; only a possible call waits."""
    ts = ToolStream(NAMES)
    for piece, out in [("Here:\n", "Here:"), ("```python\nprint(1)\n", "\n```python\nprint(1)"),
                       ("```\n", ""), ('{"name": "Paris", ', '\n```\n{"name": "Paris",'),
                       ('"x": 1}\n```json\n{"na', ' "x": 1}'), ('me": "get_w', ""), ('eather"', "")]:
        assert ts.feed(piece) == out, piece
    assert ts.holding  # it names a tool: held to the end


# ------------------------------------------------------------------ round trips with the openai client
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_a_tool_round_trip(open_api, monkeypatch):
    sc = Scripted(monkeypatch, open_api.session.engine, [CALL, "It is sunny in Paris."])
    c = open_api.client(max_retries=0)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = c.chat.completions.create(model="gpt-4o-mini", messages=msgs, tools=TOOLS, tool_choice="auto")
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert '"name": "get_weather"' in sc.prompts[0] and "<tools>" in sc.prompts[0]  # the tools reached the template

    msgs += [ch.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "c": 21}'}]
    r2 = c.chat.completions.create(model="gpt-4o-mini", messages=msgs, tools=TOOLS)
    assert r2.choices[0].finish_reason == "stop" and r2.choices[0].message.content == "It is sunny in Paris."
    assert not r2.choices[0].message.tool_calls
    second = sc.prompts[-1]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in second
    assert '<tool_response>\n{"sky": "sunny", "c": 21}\n</tool_response>' in second


def test_streamed_tool_call_deltas_reassemble_to_the_same_call(open_api, monkeypatch):
    Scripted(monkeypatch, open_api.session.engine, ["Checking. " + CALL, "Checking. " + CALL])
    c = open_api.client(max_retries=0)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    whole = c.chat.completions.create(model="x", messages=msgs, tools=TOOLS).choices[0].message
    content, calls, finish = "", {}, None
    for chunk in c.chat.completions.create(model="x", messages=msgs, tools=TOOLS, stream=True):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or ():
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            if tc.function is not None:
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert content.strip() == whole.content == "Checking."
    assert [(s["name"], json.loads(s["arguments"])) for s in calls.values()] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in whole.tool_calls]
    assert all(s["id"].startswith("call_") for s in calls.values())


def streamed(c, **kw):
    """(content, {index: call}, finish, chunks) of a streamed chat answer, as a client puts it together."""
    content, calls, finish, chunks = "", {}, None, []
    for chunk in c.chat.completions.create(stream=True, **kw):
        chunks.append(chunk)
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or ():
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": "", "deltas": 0})
            slot["id"] = tc.id or slot["id"]
            if tc.function is not None:
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
                slot["deltas"] += bool(tc.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish, chunks


@pytest.mark.parametrize("template", [TOOL_TEMPLATE, None], ids=["hermes template", "template without tools"])
@pytest.mark.parametrize("form", ["hermes", "fenced", "bare", "doubled braces"])
def test_each_form_comes_back_as_tool_calls_streamed_or_not(open_api, monkeypatch, template, form):
    Scripted(monkeypatch, open_api.session.engine, [WRITTEN[form]] * 2, template)
    c = open_api.client(max_retries=0)
    kw = dict(model="x", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, tool_choice="auto")
    ch = c.chat.completions.create(**kw).choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls] == [PARIS]
    content, calls, finish, chunks = streamed(c, **kw)
    assert finish == "tool_calls" and content == "" and list(calls) == [0]
    assert (calls[0]["name"], json.loads(calls[0]["arguments"])) == PARIS and calls[0]["id"].startswith("call_")
    assert calls[0]["deltas"] > 1  # the arguments come in pieces, as OpenAI streams them
    first = chunks[0].choices[0].delta  # the call opens the answer: role and call together, content null
    assert first.role == "assistant" and first.tool_calls and first.content is None
    assert "content" in first.model_fields_set  # sent as null, not left out


def test_a_streamed_answer_opens_with_the_role_and_empty_content(open_api, monkeypatch):
    Scripted(monkeypatch, open_api.session.engine, ["It is sunny."])
    c = open_api.client(max_retries=0)
    content, calls, finish, chunks = streamed(c, model="x", messages=[{"role": "user", "content": "hi"}],
                                              tools=TOOLS)
    assert (content, calls, finish) == ("It is sunny.", {}, "stop")
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content == "" and not first.tool_calls


def test_a_template_without_tools_is_taught_them_and_shown_the_calls(open_api, monkeypatch):
    """The tiny model's ChatML prints no tools: they go into a system message with the Hermes format, the call
    turn and the result are written as Hermes text, and what the model writes is read back."""
    from localspec.server.tool_template import TOOLS_PROMPT

    sc = Scripted(monkeypatch, open_api.session.engine, [WRITTEN["fenced"], "Sunny, 21 C."], template=None)
    c = open_api.client(max_retries=0)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    r = c.chat.completions.create(model="x", messages=msgs, tools=TOOLS)
    first = sc.prompts[-1]
    assert first.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and first.count("<|im_start|>system") == 1
    assert TOOLS_PROMPT.split("{tools}")[1].replace("{{", "{").replace("}}", "}") in first
    assert json.dumps(TOOLS[0]) in first
    call = r.choices[0].message.tool_calls[0]
    msgs += [r.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]
    r2 = c.chat.completions.create(model="x", messages=msgs, tools=TOOLS)
    assert r2.choices[0].message.content == "Sunny, 21 C."
    second = sc.prompts[-1]
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           '</tool_call><|im_end|>' in second
    assert '<|im_start|>user\n<tool_response>\n{"sky": "sunny"}\n</tool_response><|im_end|>' in second
    # under auto the answer is held to the tools' schemas once a call starts (a lazy grammar); none without tools
    from localspec.server.grammar import Lazy

    assert all(isinstance(x, Lazy) for x in sc.constraints)


def test_text_that_is_no_call_is_content_and_without_tools_nothing_is_parsed(open_api, monkeypatch):
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": '
    Scripted(monkeypatch, open_api.session.engine, [broken, broken, CALL])
    c = open_api.client(max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    r = c.chat.completions.create(model="x", messages=msgs, tools=TOOLS)
    assert r.choices[0].message.content == broken and r.choices[0].finish_reason == "stop"
    text = "".join(ch.choices[0].delta.content or "" for ch in
                   c.chat.completions.create(model="x", messages=msgs, tools=TOOLS, stream=True) if ch.choices)
    assert text == broken
    r = c.chat.completions.create(model="x", messages=msgs)  # no tools: the text is the answer
    assert r.choices[0].message.content == CALL and not r.choices[0].message.tool_calls


@pytest.mark.parametrize("body,param", [
    ({"tools": "nope"}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": "x"}]}, "messages"),
])
def test_bad_tools_are_400_naming_the_field(open_api, body, param):
    req = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
    status, _, err = open_api.raw("POST", "/v1/chat/completions", json.dumps(req))
    assert status == 400 and err["error"]["param"] == param, err


def test_tool_messages_reach_the_models_own_template(open_api):
    """No scripting: the tiny model's ChatML template gets a tool turn and an assistant call and answers (200)."""
    c = open_api.client(max_retries=0)
    r = c.chat.completions.create(model="x", max_tokens=3, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}])
    assert r.choices[0].finish_reason in ("stop", "length")


def test_segments_with_tools_and_an_empty_call_turn_are_the_templates_own_text():
    from localspec.core.chat_template import ChatTemplate

    t = ChatTemplate(TOOL_TEMPLATE, origin="t")
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain <|im_end|>"}]
    segs = t.segments(msgs, tools=TOOLS)
    assert "".join(s.text for s in segs) == t.render(msgs, True, TOOLS)
    assert [s.text for s in segs if s.content] == ["Weather?", "rain <|im_end|>"]  # tool output stays plain text


def test_tools_with_a_response_format_take_a_call_or_the_formats_json(open_api, monkeypatch):
    """response_format with tools under auto: the answer is a call or JSON of the schema (one grammar over the
    whole answer), not the schema's JSON only."""
    from localspec.server.grammar import Grammar, Lazy

    sc = Scripted(monkeypatch, open_api.session.engine, [WRITTEN["bare"]])
    c = open_api.client(max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": {
        "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}
    r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
                                  response_format=fmt)
    assert r.choices[0].finish_reason == "tool_calls"
    (con,) = sc.constraints
    assert isinstance(con, Grammar) and not isinstance(con, Lazy)
    assert accepts(con.grammar, '{"answer": "sunny"}') and accepts(con.grammar, WRITTEN["bare"])
    assert not accepts(con.grammar, "It is sunny.")


# ------------------------------------------------------------------ an answer cut off after its calls
CUT = {
    "hermes": CALL + '\n<tool_call>\n{"name": "add", "arguments": {"a": ',
    "lines": '{"name": "get_weather", "arguments": {"city": "Paris"}}\n{"name": "add", "argu',
    "fenced": '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n{"name": "ad',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", "arg',
}


@pytest.mark.parametrize("form", CUT)
def test_a_call_cut_off_by_the_answers_end_is_dropped_and_the_whole_ones_come_back(form):
    assert one(CUT[form]) == ("", [PARIS])
    assert one("Checking.\n" + CUT[form]) == ("Checking.", [PARIS])
    for size in (1, 5):
        ts = ToolStream(NAMES)
        sent = "".join(ts.feed(CUT[form][i:i + size]) for i in range(0, len(CUT[form]), size))
        rest, calls = ts.end()
        assert sent + rest == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [PARIS]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "add", "arguments": {"a": ',  # no whole call: the text stays content
    CALL + '\n<tool_call>\n{"name": "add", "arguments": {"a": 1}</tool_call>',  # closed, but broken: no cut
    CALL + '\nand some words',
])
def test_a_broken_call_that_no_cut_explains_keeps_the_answer_content(text):
    assert parse(text, NAMES) == (text, [])


class Cut(Scripted):
    """Scripted answers that end at the token limit."""

    def generate(self, tokens, cfg, cancel=None):
        for ev in super().generate(tokens, cfg, cancel):
            if type(ev).__name__ == "Finished":
                ev = type(ev)(ev.text, ev.tokens, "length", ev.stats)
            yield ev


def test_calls_before_the_token_limit_come_back_with_finish_reason_length(open_api, monkeypatch):
    Cut(monkeypatch, open_api.session.engine, [CUT["hermes"]] * 2)
    c = open_api.client(max_retries=0)
    kw = dict(model="x", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, max_tokens=30)
    ch = c.chat.completions.create(**kw).choices[0]
    assert ch.finish_reason == "length" and ch.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls] == [PARIS]
    content, calls, finish, _ = streamed(c, **kw)
    assert (content, finish) == ("", "length")
    assert [(s["name"], json.loads(s["arguments"])) for s in calls.values()] == [PARIS]


# ------------------------------------------------------------------ a call echoed after its result
RESULT = '{"temp_c": 31, "sky": "clear"}'
ECHO = {
    # what Qwen2.5-Coder-1.5B writes after the result, held by the lazy grammar to the call's own keys
    "doubled braces": '{{"name": "get_weather", "arguments": {"city": "Paris"}}}',
    # what it writes free (llama-server): the call with its result
    "with its response": '{{"name": "get_weather", "arguments": {"city": "Paris"}, "response": ' + RESULT + '}}',
    "hermes": CALL,
}


def answered(extra=()):
    """A conversation in which get_weather(Paris) was called and answered; `extra`: messages after that."""
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": RESULT}, *extra]


ANSWER = "It is 31 C and clear in Paris."
RETRIED = "the answer repeated a call already answered in this turn; answered again without tool calls"


def tokens(text):  # what Scripted counts: a token per 3 characters
    return math.ceil(len(text) / 3)


@pytest.mark.parametrize("form", [*ECHO, "fenced", "twice"])
def test_an_answer_that_only_echoes_an_answered_call_is_generated_again_without_tools(open_api, monkeypatch, form):
    echo = {**ECHO, "fenced": WRITTEN["fenced"], "twice": ECHO["hermes"] + "\n" + ECHO["hermes"]}[form]
    sc = Scripted(monkeypatch, open_api.session.engine, ["\n" + echo + "\n", ANSWER] * 2)
    c = open_api.client(max_retries=0)
    kw = dict(model="x", messages=answered(), tools=TOOLS, tool_choice="auto")
    r = c.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and not ch.message.tool_calls and ch.message.content == ANSWER
    assert r.model_extra["localspec"]["retried"] == RETRIED
    # the second generation is a tool_choice none request's: its prompt shows no tools, no grammar holds it
    assert "<tools>" in sc.prompts[-2] and "<tools>" not in sc.prompts[-1] and "get_weather" in sc.prompts[-1]
    assert sc.constraints[0] is not None and sc.constraints[1] is None
    assert r.usage.completion_tokens == tokens("\n" + echo + "\n") + tokens(ANSWER)
    content, calls, finish, chunks = streamed(c, stream_options={"include_usage": True}, **kw)
    assert (content, calls, finish) == (ANSWER, {}, "stop")
    # nothing of the echo reached the client: the role opens the answer, then the second answer's text
    sent = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert sent[0].role == "assistant" and "".join(d.content or "" for d in sent) == ANSWER
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].model_extra["localspec"]["retried"] == RETRIED


def test_usage_counts_both_generations(open_api, monkeypatch):
    Scripted(monkeypatch, open_api.session.engine, [ANSWER, ANSWER, ECHO["hermes"], ANSWER])
    c = open_api.client(max_retries=0)
    kw = dict(model="x", messages=answered(), tools=TOOLS)
    first = c.chat.completions.create(**kw).usage.prompt_tokens  # the request's prompt, with its tools
    again = c.chat.completions.create(tool_choice="none", **kw).usage.prompt_tokens  # the same without them
    u = c.chat.completions.create(**kw).usage
    assert first > again and u.prompt_tokens == first + again
    assert u.completion_tokens == tokens(ECHO["hermes"]) + tokens(ANSWER) and u.total_tokens == \
        u.prompt_tokens + u.completion_tokens


@pytest.mark.parametrize("answer,calls", [
    ("Let me check again. " + ECHO["doubled braces"], []),  # something else said: the answer stands
    (ECHO["hermes"] + "\n" + CALL.replace("Paris", "Oslo"), [("get_weather", {"city": "Oslo"})]),  # a new call
])
def test_an_echo_with_more_in_the_answer_is_not_generated_again(open_api, monkeypatch, answer, calls):
    Scripted(monkeypatch, open_api.session.engine, [answer] * 2)  # a second generation would find no answer
    c = open_api.client(max_retries=0)
    kw = dict(model="x", messages=answered(), tools=TOOLS, tool_choice="auto")
    r = c.chat.completions.create(**kw)
    ch = r.choices[0]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls or ()] == calls
    assert calls or ch.message.content == answer
    assert "retried" not in r.model_extra["localspec"]
    content, got, finish, _ = streamed(c, **kw)
    assert [(s["name"], json.loads(s["arguments"])) for s in got.values()] == calls
    assert calls or content == answer


@pytest.mark.parametrize("choice,extra", [
    ("auto", ()),  # a first turn: nothing answered yet
    ("required", None), ({"type": "function", "function": {"name": "get_weather"}}, None),  # a forced call
])
def test_a_call_where_none_was_answered_or_one_was_asked_for_is_not_generated_again(open_api, monkeypatch, choice,
                                                                                    extra):
    Scripted(monkeypatch, open_api.session.engine, [CALL] * 2)
    c = open_api.client(max_retries=0)
    msgs = answered()[:1] if extra == () else answered()
    kw = dict(model="x", messages=msgs, tools=TOOLS, tool_choice=choice)
    r = c.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls" and "retried" not in r.model_extra["localspec"]
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]
    _, calls, finish, _ = streamed(c, **kw)
    assert finish == "tool_calls" and [s["name"] for s in calls.values()] == ["get_weather"]


def test_each_of_n_choices_is_generated_again_on_its_own(open_api, monkeypatch):
    # choice 0 echoes, choice 1 answers; choice 0's second generation comes after choice 1 (queued first)
    Scripted(monkeypatch, open_api.session.engine, [ECHO["hermes"], "Sunny.", ANSWER])
    c = open_api.client(max_retries=0)
    r = c.chat.completions.create(model="x", messages=answered(), tools=TOOLS, n=2)
    assert [ch.message.content for ch in r.choices] == [ANSWER, "Sunny."]
    assert [x.get("retried") for x in r.model_extra["localspec"]["choices"]] == [RETRIED, None]


def sse(s, path, body):
    """The data objects of a streamed POST, as sent."""
    conn = http.client.HTTPConnection(s.host, int(s.port), timeout=60)
    try:
        conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        blocks = r.read().decode().split("\n\n")
        return [json.loads(line[len("data: "):]) for b in blocks for line in b.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"]
    finally:
        conn.close()


RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}
RESPONSES_INPUT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": RESULT}]


def test_an_echo_on_responses_is_generated_again(open_api, monkeypatch):
    sc = Scripted(monkeypatch, open_api.session.engine, [ECHO["doubled braces"], ANSWER] * 2)
    body = {"tools": [RESPONSES_TOOL], "input": RESPONSES_INPUT}
    status, _, whole = open_api.raw("POST", "/v1/responses", json.dumps(body))
    assert status == 200, whole
    assert [(o["type"], o["content"][0]["text"]) for o in whole["output"]] == [("message", ANSWER)], whole
    assert whole["localspec"]["retried"] == RETRIED and "<tools>" not in sc.prompts[-1]
    events = sse(open_api, "/v1/responses", body)
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == ANSWER
    assert not any("get_weather" in json.dumps(e) for e in events if e["type"] != "response.created"
                   and e["type"] != "response.in_progress" and e["type"] != "response.completed")
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message"] and final["localspec"]["retried"] == RETRIED
    assert final["usage"]["output_tokens"] == whole["usage"]["output_tokens"] == \
        tokens(ECHO["doubled braces"]) + tokens(ANSWER)


def test_an_echo_on_messages_is_generated_again(open_api, monkeypatch):
    Scripted(monkeypatch, open_api.session.engine, [ECHO["hermes"], ANSWER] * 2)
    body = {"model": "x", "max_tokens": 100, "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"][
        "parameters"]}], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT}]}]}
    status, _, whole = open_api.raw("POST", "/v1/messages", json.dumps(body))
    assert status == 200, whole
    assert whole["content"] == [{"type": "text", "text": ANSWER}] and whole["stop_reason"] == "end_turn"
    assert whole["localspec"]["retried"] == RETRIED
    events = sse(open_api, "/v1/messages", body)
    assert [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"] == ["text"]
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == ANSWER
    end = next(e for e in events if e["type"] == "message_delta")
    assert end["delta"]["stop_reason"] == "end_turn" and end["localspec"]["retried"] == RETRIED
    assert end["usage"]["output_tokens"] == whole["usage"]["output_tokens"]


def test_a_streamed_message_generated_again_after_pings_loses_nothing(open_api, monkeypatch):
    import time

    from localspec.server import anthropic_answer as AA

    sc = Scripted(monkeypatch, open_api.session.engine, [ECHO["hermes"], ANSWER])
    scripted = sc.generate

    def slow(*a, **kw):  # a long prefill: pings while each generation has sent nothing yet
        time.sleep(0.3)
        yield from scripted(*a, **kw)

    monkeypatch.setattr(open_api.session.engine, "generate", slow)
    monkeypatch.setattr(AA, "PING_S", 0.05)
    events = sse(open_api, "/v1/messages", {"model": "x", "max_tokens": 100, "tools": [{
        "name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT}]}]})
    assert [e["type"] for e in events].count("ping") > 2
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == ANSWER
    assert next(e for e in events if e["type"] == "message_delta")["localspec"]["retried"] == RETRIED


@pytest.mark.parametrize("answer,extra", [
    # other arguments: a new call
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', ()),
    # the user asks again: the same call is a new one
    (ECHO["doubled braces"], ({"role": "assistant", "content": "31 C and clear."},
                              {"role": "user", "content": "And now?"})),
])
def test_a_call_that_is_no_echo_of_an_answered_one_is_a_call(open_api, monkeypatch, answer, extra):
    Scripted(monkeypatch, open_api.session.engine, [answer])
    c = open_api.client(max_retries=0)
    ch = c.chat.completions.create(model="x", messages=answered(extra), tools=TOOLS).choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls


def test_a_cut_answer_on_responses_keeps_its_whole_calls(open_api, monkeypatch):
    Cut(monkeypatch, open_api.session.engine, [CUT["hermes"]])
    status, _, body = open_api.raw("POST", "/v1/responses", json.dumps({"tools": [{
        "type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}],
        "input": "Weather in Paris?"}))
    assert status == 200 and body["status"] == "incomplete", body
    assert [(o["type"], o.get("name")) for o in body["output"]] == [("function_call", "get_weather")], body


def test_which_calls_count_as_answered():
    from localspec.server.tool_calls import reading

    def turn(calls, results):
        return [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": i, "type": "function", "function": {"name": "add", "arguments": {"a": a}}}
                    for i, a in calls]},
                *[{"role": "tool", "content": "3", **({"tool_call_id": r} if r else {})} for r in results]]

    def echoed(msgs, a):  # whether add(a) is read as an echo
        return parse('{"name": "add", "arguments": {"a": %d}}' % a, reading(NAMES, msgs))[1] == []

    both = turn([("c1", 1), ("c2", 2)], ["c1"])
    assert echoed(both, 1) and not echoed(both, 2)  # c2 has no result yet
    assert echoed(turn([("c1", 1)], [None]), 1)  # a result without ids answers the calls before it
    assert not echoed(turn([("c1", 1)], []), 1)  # no result
    sent = turn([("c1", 1)], ["c1"])
    sent[1]["tool_calls"][0]["function"]["arguments"] = '{"b":  [2], "a": 1}'  # as the client sent it
    assert parse('{"name": "add", "arguments": {"a": 1, "b": [2]}}', reading(NAMES, sent))[1] == []
    assert parse('{"name": "add", "arguments": {"a": 1}}', reading(NAMES, turn([("c1", 1)], ["c1"]), True,
                                                                      "required"))[1]  # forced: a call
