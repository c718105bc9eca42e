"""tool_choice "required" / a named function decoded under a grammar: the answer is a call of the
allowed tool(s) in the chat template's own format, its arguments following the function's JSON schema, with
speculation kept on (the same answer with method none and draft at temperature 0)."""

from __future__ import annotations

import json
import re

import pytest

from helpers import post

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MSG = [{"role": "user", "content": "the cat and the dog"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def check_weather(args: dict):
    assert set(args) == {"city", "days"} and isinstance(args["city"], str) and len(args["city"]) <= 8
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 7


def ask(c, tool_choice, method="draft", **kw):
    return c.chat.completions.create(model="x", messages=MSG, tools=[WEATHER, CLOCK], tool_choice=tool_choice,
                                     max_tokens=120, temperature=0, extra_body={"localspec": {"method": method}},
                                     **kw)


def test_a_named_function_is_called_with_schema_arguments_and_speculation_kept(open_api):
    c = open_api.client(max_retries=0)
    answers = {}
    for method in ("none", "draft"):
        r = ask(c, NAMED, method)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        (call,) = ch.message.tool_calls
        assert call.function.name == "get_weather"
        check_weather(json.loads(call.function.arguments))
        answers[method] = call.function.arguments
        if method == "draft":
            assert r.model_extra["localspec"]["drafted"] > 0
    assert answers["none"] == answers["draft"]
    # without the grammar this model writes no call at all
    free = ask(c, "auto", "none").choices[0]
    assert free.message.tool_calls is None and free.finish_reason != "tool_calls"


def test_required_calls_one_of_the_tools(open_api):
    c = open_api.client(max_retries=0)
    ch = ask(c, "required").choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
    for call in ch.message.tool_calls:
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            check_weather(args)
        else:
            assert call.function.name == "get_time" and args in ({"zone": "utc"}, {"zone": "local"})


def test_a_streamed_forced_call_reassembles_to_the_whole_answers(open_api):
    c = open_api.client(max_retries=0)
    whole = ask(c, NAMED).choices[0].message.tool_calls[0].function
    name, args, finish = None, "", None
    for ch in ask(c, NAMED, stream=True):
        if not ch.choices:
            continue
        for d in ch.choices[0].delta.tool_calls or ():
            name = d.function.name or name
            args += d.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert (name, args, finish) == (whole.name, whole.arguments, "tool_calls")


def test_parameters_llguidance_cannot_enforce_are_a_400_naming_tools(open_api):
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}}}
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        status, _, err = post(open_api, "/v1/chat/completions", {"messages": MSG, "tools": [WEATHER, bad],
                                                                 "max_tokens": 2, "tool_choice": choice})
        assert status == 400 and err["error"]["param"] == "tools[1]", err


@pytest.mark.parametrize("template,fmt", [("... <tool_call> ...", "hermes"), ("[TOOL_CALLS]", "mistral"),
                                          ("<|start_header_id|>", "llama3"), (None, "json")])
def test_each_template_format_is_decoded_and_read_back(target_path, template, fmt):
    """The grammar for each format, run on the tiny model: what it writes is read back as the call by parse()."""
    from localspec.core.engine import Engine, GenConfig
    from localspec.server.tool_calls import parse
    from localspec.server import tool_grammar as TG
    from localspec.server.grammar import Grammar

    assert TG.call_format(template) == fmt
    eng = Engine.load(target_path, n_ctx=512)
    try:
        for choice in (NAMED, "required"):
            g = TG.choice_grammar([WEATHER, CLOCK], choice, template, parallel=fmt == "hermes")
            fin = eng.complete(eng.raw_prompt("the cat"), GenConfig(method="lookup", max_tokens=150,
                                                                    constraint=Grammar(g, eng.target)))
            assert fin.finish_reason == "stop", fin.text
            if fmt == "hermes":
                assert fin.text.startswith("<tool_call>\n{") and fin.text.endswith("}\n</tool_call>")
            content, calls = parse(fin.text, {"get_weather", "get_time"})
            assert calls and content == "", fin.text
            if choice is NAMED or fmt != "hermes":
                assert len(calls) == 1
            if choice is NAMED:
                assert [c.name for c in calls] == ["get_weather"]
                check_weather(json.loads(calls[0].arguments))
    finally:
        eng.close()


def test_auto_lets_the_model_write_until_it_starts_a_call_then_holds_the_call_to_the_schema(target_path):
    """tool_choice auto with a marker format (Hermes): a lazy grammar, free until `<tool_call>`, then the call;
    a rollback past the marker frees it again (speculation's look-ahead)."""
    from localspec.llama.model import Model
    from localspec.server import tool_grammar as TG
    from localspec.server.grammar import Lazy

    g, trigger = TG.auto_grammar([WEATHER], "auto", "<tool_call>")
    assert re.match(trigger, "<tool_call>") and TG.auto_grammar([WEATHER], "none", "<tool_call>") is None
    # a call written as JSON, fenced or bare, triggers it too, once it names one of the tools; with no marker in
    # the template, only that
    for text in ('```json\n{\n  "name": "get_weather"', 'ok {"name": "get_weather"', '{{"name": "get_weather"'):
        assert re.search(trigger, text), text
    assert not re.search(trigger, '{"name": "get_time"') and not re.search(trigger, "use get_weather")
    assert not re.search(TG.auto_grammar([WEATHER], "auto", None)[1], "<tool_call>")
    with Model(target_path, n_ctx=256) as m:
        lazy = Lazy(g, m, trigger)
        full = m.tokenize("the cat\n<tool_call>\n", add_special=False, parse_special=False)
        i = next(i for i, t in enumerate(full) if m.piece(t).startswith(b"<"))
        free, call = full[:i + 2], full[i + 2:]  # the marker split across the two consume calls
        assert b"".join(m.piece(t) for t in free[i:]) == b"<t"
        assert lazy.consume(free) and not lazy.active and lazy.allowed().all()
        assert lazy.consume(call) and lazy.active
        allowed = lazy.allowed()
        assert 0 < allowed.sum() < len(allowed)
        assert all(m.piece(int(t)).startswith(b"{") for t in allowed.nonzero()[0])  # the call's JSON begins
        lazy.rollback(len(call))
        assert not lazy.active and lazy.allowed().all()
        assert lazy.consume(call) and lazy.active  # and again, from the same state
        lazy.rollback(len(call) + len(free))
        assert lazy.tokens == [] and not lazy.active
        x = m.tokenize("<tool_call>x", add_special=False, parse_special=False)[1:]
        assert lazy.consume(full[:i] + x[:-1]) and lazy.active
        assert not lazy.allowed()[x[-1]]  # once the marker is written, only the call may follow


@pytest.mark.parametrize("text", ['Sure.\n```json\n{\n  "name": "get_weather",', '{{"name": "get_weather", ',
                                  'It is {"name": "get_weather", '])
def test_auto_holds_a_call_written_as_json_once_it_names_a_tool(target_path, text):
    """With no marker to wait for, the lazy grammar starts where a fenced or bare call starts, once the call names
    one of the tools: from there only the call's JSON may follow; a rollback before the name frees it again."""
    from localspec.llama.model import Model
    from localspec.server import tool_grammar as TG
    from localspec.server.grammar import Lazy

    g, trigger = TG.auto_grammar([WEATHER, CLOCK], "auto", None)
    with Model(target_path, n_ctx=256) as m:
        lazy = Lazy(g, m, trigger)
        toks = m.tokenize(text, add_special=False, parse_special=False)
        seen, started = b"", None
        for i, t in enumerate(toks):
            assert lazy.consume([t])
            seen += m.piece(t)
            if lazy.active and started is None:
                started = i
        assert started is not None and b'"get_weather"' in b"".join(m.piece(t) for t in toks[:started + 1])
        assert b'"get_weather"' not in b"".join(m.piece(t) for t in toks[:started])  # not before the name
        allowed = lazy.allowed()
        assert 0 < allowed.sum() < len(allowed)
        ok = [m.piece(int(t)) for t in allowed.nonzero()[0]]
        assert all(p.lstrip(b" \r\n").startswith(b'"') or not p.strip(b" \r\n") for p in ok), ok  # "arguments" next
        lazy.rollback(len(toks) - started)
        assert not lazy.active and lazy.allowed().all()
        assert lazy.consume(toks[started:]) and lazy.active


def test_auto_does_not_start_on_a_name_no_tool_has(target_path):
    from localspec.llama.model import Model
    from localspec.server import tool_grammar as TG
    from localspec.server.grammar import Lazy

    g, trigger = TG.auto_grammar([WEATHER, CLOCK], "auto", None)
    with Model(target_path, n_ctx=256) as m:
        lazy = Lazy(g, m, trigger)
        for text in ('```json\n{"name": "get_weather_now", "x": 1}', ' use get_weather or "get_time"'):
            assert lazy.consume(m.tokenize(text, add_special=False, parse_special=False))
            assert not lazy.active and lazy.allowed().all()


def test_a_hermes_template_through_the_server(open_api, monkeypatch):
    """With a template that teaches Hermes calls: a forced call is written as <tool_call>...</tool_call> and read
    back; under auto the model still answers freely (the lazy grammar waits for the marker)."""
    import localspec.server.app as A

    monkeypatch.setattr(A, "template_text", lambda eng: "... <tool_call> ...")
    c = open_api.client(max_retries=0)
    ch = ask(c, NAMED, "draft").choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls[0].function.name == "get_weather"
    check_weather(json.loads(ch.message.tool_calls[0].function.arguments))
    free = ask(c, "auto", "draft").choices[0]
    assert free.finish_reason in ("stop", "length") and free.message.content


# pydantic-style parameters: nested models in `$defs` (pydantic v2) or `definitions` (v1), reached by `$ref`. Two
# tools define a `Unit` each, with different values: each call's arguments must follow its own tool's `Unit`.
def defs_tool(name: str, units: list[str], key: str) -> dict:
    ref = f"#/{key}/"
    return {"type": "function", "function": {"name": name, "parameters": {
        key: {"Unit": {"title": "Unit", "type": "string", "enum": units},
              "Reading": {"title": "Reading", "type": "object", "properties": {
                  "value": {"type": "integer", "minimum": 0, "maximum": 99}, "unit": {"$ref": ref + "Unit"}},
                  "required": ["value", "unit"], "additionalProperties": False}},
        "title": name, "type": "object", "properties": {"reading": {"$ref": ref + "Reading"},
                                                        "fallback": {"$ref": ref + "Unit"}},
        "required": ["reading", "fallback"]}}}


UNITS = {"log_temp": ["celsius", "kelvin"], "log_speed": ["kmh", "knots"]}


def defs_tools(key: str) -> list[dict]:
    return [defs_tool(name, units, key) for name, units in UNITS.items()]


def check_defs_call(name: str, args: dict):
    units = UNITS[name]
    assert set(args) == {"reading", "fallback"} and args["fallback"] in units, args
    r = args["reading"]
    assert set(r) == {"value", "unit"} and r["unit"] in units and isinstance(r["value"], int), args
    assert 0 <= r["value"] <= 99


@pytest.mark.parametrize("key", ["$defs", "definitions"])
def test_tools_with_defs_are_enforced_for_required_and_named(open_api, key):
    c = open_api.client(max_retries=0)
    for choice in ("required", {"type": "function", "function": {"name": "log_speed"}}):
        r = c.chat.completions.create(model="x", messages=MSG, tools=defs_tools(key), tool_choice=choice,
                                      max_tokens=200, temperature=0, extra_body={"localspec": {"method": "draft"}})
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch
        for call in ch.message.tool_calls:
            check_defs_call(call.function.name, json.loads(call.function.arguments))
        if isinstance(choice, dict):
            assert [call.function.name for call in ch.message.tool_calls] == ["log_speed"]


@pytest.mark.parametrize("template,fmt", [("... <tool_call> ...", "hermes"), ("[TOOL_CALLS]", "mistral"),
                                          ("<|start_header_id|>", "llama3"), (None, "json")])
def test_defs_resolve_in_each_format_and_for_each_tool(target_path, template, fmt):
    """Each layout nests a function's parameters at another place in the call grammar; its `$ref`s follow them.
    Each tool is forced in turn, so both tools' own definitions are decoded."""
    from localspec.core.engine import Engine, GenConfig
    from localspec.server.tool_calls import parse
    from localspec.server import tool_grammar as TG
    from localspec.server.grammar import Grammar

    eng = Engine.load(target_path, n_ctx=512)
    try:
        for key in ("$defs", "definitions"):
            tools = defs_tools(key)
            for choice in ["required"] + [{"type": "function", "function": {"name": n}} for n in UNITS]:
                g = TG.choice_grammar(tools, choice, template, parallel=False)
                fin = eng.complete(eng.raw_prompt("the cat"), GenConfig(method="lookup", max_tokens=200,
                                                                        constraint=Grammar(g, eng.target)))
                assert fin.finish_reason == "stop", fin.text
                content, calls = parse(fin.text, set(UNITS))
                assert len(calls) == 1 and content == "", fin.text
                if isinstance(choice, dict):
                    assert calls[0].name == choice["function"]["name"]
                check_defs_call(calls[0].name, json.loads(calls[0].arguments))
    finally:
        eng.close()


def test_auto_holds_a_call_to_parameters_with_defs(target_path):
    """tool_choice auto (Hermes): the lazy grammar is built for `$defs` schemas too, and a call that follows the
    marker is decoded under them."""
    from localspec.core.engine import Engine, GenConfig
    from localspec.server.tool_calls import parse
    from localspec.server import tool_grammar as TG
    from localspec.server.grammar import Grammar

    for key in ("$defs", "definitions"):
        got = TG.auto_grammar(defs_tools(key), "auto", "<tool_call>", parallel=False)
        assert got is not None
        g, trigger = got
        assert trigger.startswith("<tool_call>|")
        eng = Engine.load(target_path, n_ctx=512)
        try:
            fin = eng.complete(eng.raw_prompt("the cat"), GenConfig(method="lookup", max_tokens=200,
                                                                    constraint=Grammar(g, eng.target)))
        finally:
            eng.close()
        assert re.match(trigger, fin.text), fin.text  # one of the call forms, from the first token
        content, calls = parse(fin.text, set(UNITS))
        assert calls and content == "", fin.text
        for call in calls:
            check_defs_call(call.name, json.loads(call.arguments))


def test_under_auto_parameters_llguidance_cannot_enforce_are_a_400_naming_the_tool(open_api, monkeypatch):
    """A lazy grammar that cannot be built is an error, not a call left unchecked."""
    import localspec.server.app as A

    monkeypatch.setattr(A, "template_text", lambda eng: "... <tool_call> ...")
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}}}
    for choice in ("auto", None):
        body = {"messages": MSG, "tools": [WEATHER, bad], "max_tokens": 2,
                **({"tool_choice": choice} if choice else {})}
        status, _, err = post(open_api, "/v1/chat/completions", body)
        assert status == 400 and err["error"]["param"] == "tools[1]", err
        assert "format" in err["error"]["message"], err
    status, _, body = post(open_api, "/v1/chat/completions", {"messages": MSG, "tools": defs_tools("$defs"),
                                                               "max_tokens": 4, "tool_choice": "auto"})
    assert status == 200, body


# ------------------------------------------------------------------ parallel_tool_calls: false is one call
def written(fmt: str, n: int, key: str = "arguments") -> str:
    call = {"name": "get_weather", key: {"city": "Oslo", "days": 2}}
    if fmt == "mistral":
        return "[TOOL_CALLS]" + json.dumps([call] * n)
    if fmt == "hermes":
        return "\n".join([f"<tool_call>\n{json.dumps(call)}\n</tool_call>"] * n)
    return "\n".join([json.dumps(call)] * n)


@pytest.mark.parametrize("template,fmt", [("... <tool_call> ...", "hermes"), ("[TOOL_CALLS]", "mistral"),
                                          ("<|start_header_id|>", "llama3"), (None, "json")])
def test_without_parallel_calls_the_grammar_closes_after_one_call(template, fmt):
    from helpers import accepts
    from localspec.server import tool_grammar as TG

    key = "parameters" if fmt == "llama3" else "arguments"
    for choice in ("required", NAMED):
        g = TG.choice_grammar([WEATHER, CLOCK], choice, template, parallel=False)
        assert accepts(g, written(fmt, 1, key)) and not accepts(g, written(fmt, 2, key)), (fmt, choice)
    g, _ = TG.auto_grammar([WEATHER, CLOCK], "auto", template, parallel=False)
    assert accepts(g, written(fmt, 1, key)) and not accepts(g, written(fmt, 2, key)), fmt
    if fmt == "hermes":  # with parallel calls: several
        assert accepts(TG.choice_grammar([WEATHER, CLOCK], "required", template, parallel=True), written(fmt, 2))


def test_without_parallel_calls_the_answer_holds_one_call(open_api, monkeypatch):
    """Forced, the grammar writes one call; under auto, of calls written in forms the grammar does not start on,
    the first is the answer's call."""
    import localspec.server.app as A
    from helpers import Scripted

    monkeypatch.setattr(A, "template_text", lambda eng: "... <tool_call> ...")
    c = open_api.client(max_retries=0)
    ch = ask(c, "required", parallel_tool_calls=False).choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    two = '{"type": "function", "function": {"name": "get_time", "arguments": {"zone": "utc"}}}\n' \
          '{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}'
    Scripted(monkeypatch, open_api.session.engine, [two, two])
    for parallel, n in ((False, 1), (True, 2)):
        ch = ask(c, "auto", parallel_tool_calls=parallel).choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == n
        assert ch.message.tool_calls[0].function.name == "get_time"
