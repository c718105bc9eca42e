"""Tool calling, the OpenAI way: the request's `tools` and the conversation's calls and results go to the chat
template (transformers' context), and the model's answer is read back into `tool_calls`.

The formats read: Hermes / Qwen `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (one or several),
Llama 3.x JSON (`{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several separated by `;`),
and Mistral `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (and the newer `[TOOL_CALLS]name[ARGS]{...}`).
Anything that does not parse as calls of the request's tools stays text: the answer is then plain content, never
an error.

`tool_choice` "required" or a named function: the answer is decoded under a grammar (llguidance, as structured
output; `choice_grammar`): one or more calls of the allowed tools in the format the chat template uses, each call's
arguments following its function's JSON schema.

Streaming (`ToolStream`): text is passed on until a tool-call start could be beginning; from there it is held back
and, at the end, sent as `tool_calls` deltas (or as content when it was not a call after all).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from localspec.server.openai import APIError

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL = "[TOOL_CALLS]"
MARKERS = (HERMES_OPEN, PYTHON_TAG, MISTRAL)
_DEC = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str

    def openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# ------------------------------------------------------------------ the request side
def check_tools(tools, tool_choice) -> tuple[list[dict] | None, set[str]]:
    """The tools to give the template (None: no tools, or tool_choice "none") and their names. 400 for a malformed
    list or a tool_choice naming no given tool."""
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None, set()
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list of function tools", param="tools")
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(f, dict)
                and isinstance(f.get("name"), str) and f["name"]):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           param=f"tools[{i}]")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON Schema object",
                           param=f"tools[{i}]")
        names.append(f["name"])
    if tool_choice is None or tool_choice in ("auto", "required"):
        pass
    elif tool_choice == "none":
        return None, set()
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        wanted = tool_choice["function"].get("name")
        if wanted not in names:
            raise APIError(400, f"tool_choice names {wanted!r}, which is not among the tools", param="tool_choice")
    else:
        raise APIError(400, "tool_choice must be \"none\", \"auto\", \"required\" or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    return [t if "type" in t else {"type": "function", **t} for t in tools], set(names)


def template_tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's `tool_calls` as chat templates read them: the arguments as an object (templates print
    them with `| tojson`), not the JSON text OpenAI sends."""
    if not isinstance(calls, list):
        raise APIError(400, f"{where} must be a list", param=where.split(".")[0].split("[")[0])
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str)):
            raise APIError(400, f"{where}[{j}] must be {{\"type\": \"function\", \"id\": ..., \"function\": "
                                "{\"name\": ..., \"arguments\": \"{...}\"}}", param=where.split("[")[0])
        args = f.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # left as text: the template prints what it was given
        out.append({"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


# ------------------------------------------------------------------ the answer side
def _as_call(obj, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict) and "name" not in obj:  # {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(name, str) or not isinstance(args, dict) or (names and name not in names):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False), _call_id())


def _json_values(text: str) -> list | None:
    """The JSON values that make up `text`, separated by whitespace, `;` or `,` (None: something else is there)."""
    out, pos = [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
        if pos == len(text):
            return out
        try:
            obj, pos = _DEC.raw_decode(text, pos)
        except ValueError:
            return None
        out.append(obj)


def _calls(values, names) -> list[ToolCall] | None:
    flat = []
    for v in values:
        flat += v if isinstance(v, list) else [v]
    calls = [_as_call(v, names) for v in flat]
    return calls if calls and all(c is not None for c in calls) else None


def parse(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a finished answer; no calls: the text unchanged as content."""
    i = text.find(HERMES_OPEN)
    if i >= 0:
        calls, rest = [], text[i:]
        for m in re.finditer(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|$)", rest, re.S):
            got = _calls(_json_values(m.group(1).strip()) or [None], names)
            if got is None:
                return text, []
            calls += got
        leftover = re.sub(re.escape(HERMES_OPEN) + r".*?(?:" + re.escape(HERMES_CLOSE) + r"|$)", "", rest, flags=re.S)
        if calls and not leftover.strip():
            return text[:i].strip(), calls
        return text, []
    i = text.find(MISTRAL)
    if i >= 0:
        body = text[i + len(MISTRAL):].strip()
        values = _json_values(body)
        calls = _calls(values, names) if values else None
        if calls is None:  # [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name2[ARGS]{...}
            calls = []
            for part in text[i:].split(MISTRAL)[1:]:
                name, sep, args = part.partition("[ARGS]")
                vals = _json_values(args.strip()) if sep else None
                c = _as_call({"name": name.strip(), "arguments": vals[0]}, names) if vals and len(vals) == 1 else None
                if c is None:
                    return text, []
                calls.append(c)
        return (text[:i].strip(), calls) if calls else (text, [])
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if body.startswith(("{", "[")):  # Llama 3.x: the whole answer is the call (or calls)
        values = _json_values(body)
        calls = _calls(values, names) if values else None
        if calls:
            return "", calls
    return text, []


class ToolStream:
    """Splits a streamed answer: `feed(text)` returns the text that is surely content; from a possible tool-call
    start on, text is held until `end()`, which returns (content still to send, calls)."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.sent = ""  # content passed on
        self.held = ""
        self.holding = False  # a marker (or a leading '{' / '[') was seen: everything from there waits for the end

    def feed(self, text: str) -> str:
        self.held += text
        if self.holding:
            return ""
        if not self.sent and self.held.lstrip().startswith(("{", "[")):
            self.holding = True
            return ""
        for mk in MARKERS:
            i = self.held.find(mk)
            if i >= 0:
                self.holding = True
                out, self.held = self.held[:i], self.held[i:]
                self.sent += out
                return out
        keep = 0  # a tail that may be the start of a marker waits for the next piece
        for mk in MARKERS:
            for n in range(min(len(mk) - 1, len(self.held)), 0, -1):
                if self.held.endswith(mk[:n]):
                    keep = max(keep, n)
                    break
        if not self.sent and not self.held.strip():
            keep = len(self.held)  # leading whitespace: the answer may still turn out to be a JSON call
        out = self.held[:len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        self.sent += out
        return out

    def end(self) -> tuple[str, list[ToolCall]]:
        content, calls = parse(self.sent + self.held, self.names)
        if calls:
            return "", calls  # the content before the calls was sent already
        rest, self.held = self.held, ""
        return rest, []


def answer_calls(body: dict, fin, names: set[str]) -> None:
    """A whole chat answer (chat.completion) with its tool calls read out of the text."""
    content, calls = parse(fin.text, names)
    if not calls:
        return
    choice = body["choices"][0]
    choice["message"] = {"role": "assistant", "content": content or None,
                         "tool_calls": [c.openai() for c in calls]}
    if fin.finish_reason != "cancelled":
        choice["finish_reason"] = "tool_calls"


def call_deltas(call: ToolCall, index: int) -> list[dict]:
    """A call as OpenAI streams it: the id and name with empty arguments, then the arguments."""
    return [{"tool_calls": [{"index": index, "id": call.id, "type": "function",
                             "function": {"name": call.name, "arguments": ""}}]},
            {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]


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
    """A function's parameters schema with its declared properties the only ones (unless it says otherwise): an
    argument the function does not take would fail the call anyway (JSON Schema's default allows any extra)."""
    params = dict(tool["function"].get("parameters") or {"type": "object", "properties": {}})
    if "properties" in params and params.get("type", "object") == "object":
        params.setdefault("additionalProperties", False)
    return params


TRIGGERS = {"hermes": HERMES_OPEN, "mistral": MISTRAL}  # formats whose calls start with a marker


def auto_grammar(tools: list[dict] | None, tool_choice, template: str | None,
                 parallel: bool = True) -> tuple[str, str] | None:
    """(grammar, trigger) for tool_choice "auto" (or none given) with tools, in a format whose calls start with a
    marker: the model writes freely, and once it writes the marker its call follows the tools' schemas (a lazy
    grammar, server/grammar.py Lazy). None: nothing to enforce (other formats, no tools, "none"). 400 (param
    tools[i]) as choice_grammar: a call that cannot be held to its schema is refused, not left unchecked."""
    if tools is None or tool_choice not in (None, "auto"):
        return None
    trigger = TRIGGERS.get(call_format(template))
    if trigger is None:
        return None
    return choice_grammar(tools, "required", template, parallel), trigger


def choice_grammar(tools: list[dict] | None, tool_choice, template: str | None, parallel: bool = True) -> str | None:
    """The llguidance grammar a tool_choice forces (None: "auto", "none" or no tools: the model chooses). "required":
    one or more calls of any of the tools (one: `parallel` False, the request's parallel_tool_calls: false);
    {"function": {"name": N}}: one call of N. 400 (param tools[i]) for a function schema llguidance cannot
    compile."""
    if tools is None or not (tool_choice == "required" or isinstance(tool_choice, dict)):
        return None
    import llguidance

    from localspec.server.grammar import JSON_STYLE, grammar_problem, rebase, usable_schema

    chosen = list(enumerate(tools))
    if isinstance(tool_choice, dict):
        chosen = [(i, t) for i, t in chosen if t["function"]["name"] == tool_choice["function"]["name"]]
        parallel = False
    fmt = call_format(template)
    key = "parameters" if fmt == "llama3" else "arguments"
    outer = "/items" if fmt == "mistral" else ""  # where the call object sits in the format's schema
    calls = []
    for n, (i, t) in enumerate(chosen):
        params, _ = usable_schema(_closed(t), f"tools[{i}].function.parameters", f"tools[{i}]")  # 400 naming it
        at = outer + (f"/anyOf/{n}" if len(chosen) > 1 else "") + f"/properties/{key}"
        calls.append({"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                       key: rebase(params, at)},
                      "required": ["name", key], "additionalProperties": False})
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if fmt == "hermes":
        more = ' ("\\n" call)*' if parallel else ""
        lark = (f'start: call{more}\ncall: "{HERMES_OPEN}\\n" %json '
                f'{json.dumps({**one, "x-guidance": JSON_STYLE})} "\\n{HERMES_CLOSE}"')
    elif fmt == "mistral":
        many = {"type": "array", "items": one, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        lark = f'start: "{MISTRAL}" %json {json.dumps({**many, "x-guidance": JSON_STYLE})}'
    else:
        lark = f'start: %json {json.dumps({**one, "x-guidance": JSON_STYLE})}'
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        problem = grammar_problem(grammar)
    except ValueError as exc:
        problem = " ".join(str(exc).split())
    if problem is not None:
        raise APIError(400, f"tools: the functions' parameters cannot be enforced for tool_choice: {problem}",
                       param="tools", code="unsupported_schema")
    return grammar
