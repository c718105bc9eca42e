"""The grammars a request's tools impose (llguidance Lark with %json schemas): for tool_choice "required" or a named
function every call is forced (`choice_grammar`); for "auto" the answer is free until it starts a call, and the call
follows the tools' schemas from there (`auto_grammar`). Each call in the format the chat template teaches
(`call_format`). A schema llguidance cannot hold is refused with a 400 naming the tool, never left unchecked."""

from __future__ import annotations

import json
import re

from localspec.server.openai import APIError
from localspec.server.tool_calls import HERMES_CLOSE, HERMES_OPEN, MISTRAL, PYTHON_TAG


# ------------------------------------------------------------------ forced calls (tool_choice required / named)
def call_format(template: str | None) -> str:
    """The call format a chat template teaches the model: hermes (Qwen, Hermes: <tool_call>...</tool_call>),
    mistral ([TOOL_CALLS][...]), llama3 (a bare {"name", "parameters"} object), or json (no known markup: a bare
    {"name", "arguments"} object, which parse() reads as well)."""
    t = template or ""
    if HERMES_OPEN in t:
        return "hermes"
    if MISTRAL in t:
        return "mistral"
    if PYTHON_TAG in t or "<|start_header_id|>" in t:
        return "llama3"
    return "json"


def _closed(tool: dict) -> dict:
    """A function's parameters schema with its declared properties the only ones, at every level (unless it says
    otherwise; json_schema.closed): an argument the function does not take would fail the call anyway."""
    from localspec.server.json_schema import closed

    return closed(tool["function"].get("parameters") or {"type": "object", "properties": {}})


# the layout of a call written without markers (a fence, a bare object): compact or pretty-printed as the model
# likes (Qwen indents), whitespace bounded to one line break and an indent so that it cannot pad on and on
LOOSE_STYLE = {"whitespace_flexible": True, "whitespace_pattern": r"(?:\r?\n)?[ ]{0,16}", "item_separator": ",",
               "key_separator": ":"}
_FENCE_OPEN = r"```(json)?[ \t]{0,16}\r?\n[ \t]{0,16}"


def _call_schema(tools: list[dict], chosen: list[tuple[int, dict]], key: str, outer: str = "") -> dict:
    """The JSON Schema of one call of any `chosen` tool ({"name": const, key: parameters}); `outer`: where the call
    sits in the schema llguidance reads (each function's `$ref`s are moved there). 400 naming tools[i]."""
    from localspec.server.grammar import usable_schema
    from localspec.server.json_schema import rebase

    calls = []
    for n, (i, t) in enumerate(chosen):
        params, _ = usable_schema(_closed(t), f"tools[{i}].function.parameters", f"tools[{i}]")
        at = outer + (f"/anyOf/{n}" if len(chosen) > 1 else "") + f"/properties/{key}"
        calls.append({"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                       key: rebase(params, at)},
                      "required": ["name", key], "additionalProperties": False})
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _compile(lark: str, what: str) -> str:
    import llguidance

    from localspec.server.grammar import grammar_problem

    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        problem = grammar_problem(grammar)
    except ValueError as exc:
        problem = " ".join(str(exc).split())
    if problem is not None:
        raise APIError(400, f"tools: the functions' parameters cannot be enforced for {what}: {problem}",
                       param="tools", code="unsupported_schema")
    return grammar


def auto_grammar(tools: list[dict] | None, tool_choice, template: str | None, parallel: bool = True, *,
                 fmt: str | None = None, output: dict | None = None) -> tuple[str, str | None] | None:
    """(grammar, trigger) for tool_choice "auto" (or none given) with tools: the model writes freely, and once its
    answer matches `trigger` (a regular expression: the format's marker, or the start of a call written as JSON,
    fenced or bare, up to the name of one of the tools) the rest follows the grammar: calls whose arguments follow
    the tools' schemas, then the end (a lazy grammar, server/grammar.py Lazy). `fmt`: the call format, when not the
    template's (call_format). `output`: the JSON Schema the answer must follow when it is no call (the request's
    response_format): then the whole answer follows the grammar, a call or that JSON, and the trigger is None.
    None: nothing to enforce (no tools, "none"). 400 (param tools[i]) as choice_grammar: a call that cannot be held
    to its schema is refused, not left unchecked."""
    if tools is None or tool_choice not in (None, "auto"):
        return None
    from localspec.server.json_schema import JSON_STYLE

    fmt = fmt or call_format(template)
    key = "parameters" if fmt == "llama3" else "arguments"
    chosen = list(enumerate(tools))
    one = _call_schema(tools, chosen, key)
    more = ' ("\\n" lcall)*' if parallel else ""
    rules = [f"lcall: %json {json.dumps({**one, 'x-guidance': LOOSE_STYLE})}",
             f"body: lcall{more} | \"{{\" lcall \"}}\"",
             f"FENCE_OPEN: /{_FENCE_OPEN}/", "FENCE_CLOSE: /[ \\t]{0,16}\\r?\\n```/"]
    alts, triggers = ["FENCE_OPEN body FENCE_CLOSE", "body"], []
    if fmt == "hermes":
        hmore = f' ("\\n{HERMES_OPEN}\\n" call "\\n{HERMES_CLOSE}")*' if parallel else ""
        alts.insert(0, f'"{HERMES_OPEN}\\n" call "\\n{HERMES_CLOSE}"{hmore}')
        rules.append(f"call: %json {json.dumps({**one, 'x-guidance': JSON_STYLE})}")
        triggers.append(re.escape(HERMES_OPEN))
    elif fmt == "mistral":
        many = {"type": "array", "items": _call_schema(tools, chosen, key, "/items"), "minItems": 1,
                **({} if parallel else {"maxItems": 1})}
        alts.insert(0, f'"{MISTRAL}" calls')
        rules.append(f"calls: %json {json.dumps({**many, 'x-guidance': JSON_STYLE})}")
        triggers.append(re.escape(MISTRAL))
    if output is not None:
        alts.append("out")
        style = {**JSON_STYLE, **(output.get("x-guidance") or {})}
        rules.append(f"out: %json {json.dumps({**output, 'x-guidance': style})}")
    names = "|".join(re.escape(t["function"]["name"]) for t in tools)
    triggers.append(f'(?:{_FENCE_OPEN})?\\{{\\{{?\\s{{0,20}}"name"\\s{{0,4}}:\\s{{0,4}}"(?:{names})"')
    lark = "start: " + " | ".join(alts) + "\n" + "\n".join(rules) + "\n"
    return _compile(lark, "tool_choice auto"), None if output is not None else "|".join(triggers)


def choice_grammar(tools: list[dict] | None, tool_choice, template: str | None, parallel: bool = True, *,
                   fmt: str | None = None) -> str | None:
    """The llguidance grammar a tool_choice forces (None: "auto", "none" or no tools: the model chooses). "required":
    one or more calls of any of the tools (one: `parallel` False, the request's parallel_tool_calls: false);
    {"function": {"name": N}}: one call of N. `fmt`: the call format, when not the template's. 400 (param
    tools[i]) for a function schema llguidance cannot compile."""
    if tools is None or not (tool_choice == "required" or isinstance(tool_choice, dict)):
        return None
    from localspec.server.json_schema import JSON_STYLE

    chosen = list(enumerate(tools))
    if isinstance(tool_choice, dict):
        chosen = [(i, t) for i, t in chosen if t["function"]["name"] == tool_choice["function"]["name"]]
        parallel = False
    fmt = fmt or call_format(template)
    key = "parameters" if fmt == "llama3" else "arguments"
    one = _call_schema(tools, chosen, key, "/items" if fmt == "mistral" else "")
    if fmt == "hermes":
        more = ' ("\\n" call)*' if parallel else ""
        lark = (f'start: call{more}\ncall: "{HERMES_OPEN}\\n" %json '
                f'{json.dumps({**one, "x-guidance": JSON_STYLE})} "\\n{HERMES_CLOSE}"')
    elif fmt == "mistral":
        many = {"type": "array", "items": one, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        lark = f'start: "{MISTRAL}" %json {json.dumps({**many, "x-guidance": JSON_STYLE})}'
    else:
        lark = f'start: %json {json.dumps({**one, "x-guidance": JSON_STYLE})}'
    return _compile(lark, "tool_choice")
