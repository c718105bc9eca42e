"""Tool calling through `localspec serve`, as the official `openai` client does it: tools and the conversation's
calls and results reach the chat template, and the answer is read back into `tool_calls` (Hermes/Qwen, Llama 3.x
JSON, Mistral), streamed as OpenAI streams them. The tiny random models never emit a call, so the round trips use a
scripted generation on the real server and the parser is tested on fixed strings."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from test_server_hardening import open_api, serving, session  # noqa: E402,F401  (fixtures)

from localspec.server.tools import ToolStream, parse  # noqa: E402

NAMES = {"get_weather", "add"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]

# A Qwen2.5-style template, cut down to what tools need (the real one prints the same markup).
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are helpful.{% endif %}

# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and tools %}{# printed above #}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for tc in message.tool_calls %}{% set tc = tc.function %}<tool_call>
{"name": "{{ tc.name }}", "arguments": {{ tc.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


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
])
def test_the_stream_splitter_gives_the_same_result_piece_by_piece(text):
    ts = ToolStream(NAMES)
    sent = "".join(ts.feed(ch) for ch in text)
    rest, calls = ts.end()
    content, want = parse(text, NAMES)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want]
    if want:
        assert sent.strip() == content
    else:
        assert sent + rest == text


# ------------------------------------------------------------------ round trips with the openai client
class Scripted:
    """Replaces the served engine's generation with fixed answers, one per request, and keeps each prompt the chat
    template rendered."""

    def __init__(self, monkeypatch, engine, answers):
        from localspec.core.chat_template import ChatTemplate

        self.answers, self.prompts = list(answers), []
        outer = self

        class Recording(ChatTemplate):
            def segments(self, messages, add_generation_prompt=True, tools=None, **kw):
                segs = super().segments(messages, add_generation_prompt, tools=tools, **kw)
                outer.prompts.append("".join(s.text for s in segs))
                return segs

        tmpl = Recording(TOOL_TEMPLATE, origin="the test template")
        monkeypatch.setattr(engine, "chat_template", lambda: tmpl)
        monkeypatch.setattr(engine, "generate", self.generate)

    def generate(self, tokens, cfg, cancel=None):
        from localspec.core.engine import Finished, Piece
        from localspec.core.stats import Stats

        text = self.answers.pop(0)
        st = Stats(prompt_tokens=len(tokens))
        pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
        for i, p in enumerate(pieces):
            st.token_emitted(now=float(i))
            yield Piece(p, i, False)
        st.elapsed_s = 1.0
        yield Finished(text, list(range(len(pieces))), "stop", st)


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
