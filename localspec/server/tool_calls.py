"""Tool calls read out of a model's answer, the OpenAI way: the forms read, which of them an answer makes, and the
calls in a whole chat answer (`answer_calls`).

The forms read: Hermes / Qwen `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (one or several),
Mistral `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (and the newer `[TOOL_CALLS]name[ARGS]{...}`), and
a call written as JSON at the end of the answer, as Llama 3.x and small models write them whatever their template
shows: bare or in a ```json fence, `{"name", "arguments"|"parameters"}` (optionally after `<|python_tag|>`, several
separated by `;` or lines), with doubled braces (`{{"name": ...}}`, as templates that escape braces print the
format), or llama.cpp's generic `{"tool_call": {...}}`. A call names one of the request's tools with arguments
that parse as a JSON object; anything else stays text (a function only mentioned is content, never an error).
A call the end of the answer cut off (the token limit, a stop string) is dropped when whole calls come before it.
Under tool_choice auto, a call that repeats one already answered in this turn (the same function and arguments,
its result in the conversation) is content: small models echo the call they just made instead of answering, and an
agent would call again forever; an answer that is nothing but such echoes is `echoed` (server/tool_retry.py). With
parallel_tool_calls false an answer holds one call (`reading`).

How the calls come to follow the tools' schemas: server/tool_grammar.py (tool_choice "auto": a lazy grammar from
the start of a call on; "required" or a named function: the whole answer under a grammar).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from localspec.server.openai import too_deep

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


class Names(frozenset):
    """The names of a request's tools, with what reading its answer needs from the request (`reading`):
    `answered`, the calls of this turn whose results the conversation holds ((name, canonical arguments));
    `parallel`, False when the answer may hold one call only."""
    answered: frozenset = frozenset()
    parallel: bool = True


def _key(name: str, arguments) -> tuple[str, str]:
    """A call as compared with others: its name and its arguments as canonical JSON (key order aside)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return name, arguments
    return name, json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def reading(names: set[str], msgs: list[dict], parallel: bool = True, tool_choice=None) -> Names:
    """`names` with what an answer to `msgs` is read against: the calls made since the last user message whose
    results follow them (a tool message with the call's id, or with no ids to match), which an answer under
    tool_choice auto may not call again; `parallel` (the request's parallel_tool_calls)."""
    out = Names(names)
    out.parallel = parallel
    if tool_choice not in (None, "auto"):  # a forced call is the answer, whatever it repeats
        return out
    start = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=-1) + 1
    answered, later, unnamed = set(), set(), False  # the ids of the results after a message; one without an id
    for m in reversed(msgs[start:]):
        if m["role"] == "tool":
            later.add(m.get("tool_call_id"))
            unnamed = unnamed or not m.get("tool_call_id")
        elif m["role"] == "assistant" and later:
            for c in m.get("tool_calls") or ():
                if c.get("id") in later or not c.get("id") or unnamed:
                    answered.add(_key(c["function"]["name"], c["function"]["arguments"]))
    out.answered = frozenset(answered)
    return out


def _kept(calls: list[ToolCall], names) -> list[ToolCall]:
    """The calls an answer makes: without those that repeat an answered call, at most one without parallel
    calls."""
    answered = getattr(names, "answered", ())
    calls = [c for c in calls if _key(c.name, c.arguments) not in answered]
    return calls[:1] if getattr(names, "parallel", True) is False else calls


# A fenced block a call may sit in: ```json, ``` or ```tool_call, up to its closing fence (or the end of the answer:
# a stop string or the token limit may cut the closing fence off).
FENCE_LANGS = ("", "json", "tool_call")
_FENCE = re.compile(r"```([A-Za-z_]*)[ \t]*\r?\n(.*?)(?:```|\Z)", re.S)
# where a call written without markers may start: a fence, a JSON object or array whose first key is coming
CALL_START = re.compile(r"```|<\|python_tag\|>|[\[{]\s*[{\"]|[\[{]\s*\Z")
# the keys a call object opens with, in the forms read (OpenAI's, Llama's, llama.cpp's generic format)
CALL_KEYS = ("name", "function", "type", "arguments", "parameters", "tool_call", "tool_calls", "id")


def _as_call(obj, names: set[str]) -> list[ToolCall] | None:
    """The call(s) a JSON value is, or None. {"name", "arguments"|"parameters"}, {"type": "function", "function":
    {...}}, and llama.cpp's generic {"tool_call": {...}} / {"tool_calls": [...]}."""
    if not isinstance(obj, dict):
        return None
    if "name" not in obj:
        if isinstance(obj.get("tool_call"), dict):
            return _as_call(obj["tool_call"], names)
        if isinstance(obj.get("tool_calls"), list):
            return _calls(obj["tool_calls"], names)
        if isinstance(obj.get("function"), dict):
            obj = obj["function"]
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return None
    if not isinstance(name, str) or not isinstance(args, dict) or (names and name not in names):
        return None
    if too_deep(args):  # arguments no request could send back (MAX_DEPTH): text
        return None
    return [ToolCall(name, json.dumps(args, ensure_ascii=False), _call_id())]


def _unfinished(text: str) -> bool:
    """Whether `text` is a JSON object or array that the end of the answer cut off: what it opens is still open
    at the end, and nothing closes what it did not open."""
    if not text.startswith(("{", "[")):
        return False
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return False  # a whole value (that did not parse)
    return True


def _json_values(text: str, cut: bool = False) -> list | None:
    """The JSON values that make up `text`, separated by whitespace, `;` or `,` (None: something else is there).
    `cut`: `text` ends where the answer ended, and a last value that the end cut off is left out (of a cut
    array, its whole items are kept, as an array)."""
    out, pos = [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
        if pos == len(text):
            return out
        try:
            obj, pos = _DEC.raw_decode(text, pos)
        except ValueError:
            if cut and _unfinished(text[pos:]):
                if text[pos] == "[":
                    items = _json_values(text[pos + 1:], cut=True)
                    if items:
                        out.append(items)
                return out
            return None
        except RecursionError:  # nested beyond any call: no call
            return None
        out.append(obj)


def _values(text: str, cut: bool = False) -> list | None:
    """_json_values, also for a call written with doubled braces (`{{"name": ...}}`, as templates that escape their
    braces for str.format show the format): one outer pair peeled off, or every pair halved."""
    got = _json_values(text, cut)
    t = text.strip()
    if not got and t.startswith("{{"):
        if t.endswith("}}"):
            got = _json_values(t[1:-1], cut) or got
        if not got:
            got = _json_values(t.replace("{{", "{").replace("}}", "}"), cut) or got
    return got


def _calls(values, names) -> list[ToolCall] | None:
    flat = []
    for v in values:
        flat += v if isinstance(v, list) else [v]
    calls = [_as_call(v, names) for v in flat]
    return [c for cs in calls for c in cs] if calls and all(c is not None for c in calls) else None


def _tail_calls(text: str, names: set[str], cut: bool = False) -> list[ToolCall] | None:
    """The calls `text` is made of (fenced JSON blocks and bare JSON values, whitespace between), or None. `cut`:
    `text` ends where the answer ended (a call the end cut off is left out)."""
    t = text.strip()
    if t.startswith(PYTHON_TAG):
        t = t[len(PYTHON_TAG):]
    parts, pos = [], 0
    for m in _FENCE.finditer(t):
        if m.group(1).lower() not in FENCE_LANGS:
            return None
        parts += [t[pos:m.start()], m.group(2)]
        pos = m.end()
    parts = [p for p in parts + [t[pos:]] if p.strip()]
    values = []
    for i, part in enumerate(parts):
        got = _values(part, cut and i == len(parts) - 1)
        if got is None:
            return None
        values += got
    if not values:
        return [] if cut and parts else None  # only a call the end cut off
    return _calls(values, names)


_HERMES = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:(" + re.escape(HERMES_CLOSE) + r")|\Z)", re.S)


def _split(text: str, names: set[str]) -> tuple[int, list[ToolCall]]:
    """(where the calls start, the calls) of a finished answer; (len(text), []) when it holds none. A call that
    the end of the answer cut off (unclosed) is left out when whole calls come before it."""
    i = text.find(HERMES_OPEN)
    if i >= 0:
        calls = []
        blocks = list(_HERMES.finditer(text, i))
        for n, m in enumerate(blocks):
            got = _tail_calls(m.group(1), names, cut=n == len(blocks) - 1 and m.group(2) is None)
            if got is None:
                return len(text), []
            calls += got
        leftover = _HERMES.sub("", text[i:])
        return (i, calls) if calls and not leftover.strip() else (len(text), [])
    i = text.find(MISTRAL)
    if i >= 0:
        body = text[i + len(MISTRAL):].strip()
        values = _json_values(body, cut=True)
        calls = _calls(values, names) if values else None
        if calls is None:  # [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name2[ARGS]{...}
            calls = []
            parts = text[i:].split(MISTRAL)[1:]
            for n, part in enumerate(parts):
                name, sep, args = part.partition("[ARGS]")
                vals = _json_values(args.strip(), cut=n == len(parts) - 1) if sep else None
                if vals == [] and n == len(parts) - 1 and calls:
                    break  # the last call's arguments, cut off
                c = _as_call({"name": name.strip(), "arguments": vals[0]}, names) \
                    if vals and len(vals) == 1 else None
                if c is None:
                    return len(text), []
                calls += c
        return (i, calls) if calls else (len(text), [])
    # no markers: the answer ends in calls written as JSON, bare or fenced (Llama 3.x, and small models whatever
    # their template shows); the first place from which the rest is nothing but calls
    for m in CALL_START.finditer(text):
        calls = _tail_calls(text[m.start():], names, cut=True)
        if calls:
            return m.start(), calls
    return len(text), []


def find_calls(text: str, names: set[str]) -> tuple[int, list[ToolCall]]:
    """(where the calls start, the calls it makes) of a finished answer: _split, then the calls kept (`_kept`);
    (len(text), []) when none is left."""
    at, calls = _split(text, names)
    calls = _kept(calls, names)
    return (at, calls) if calls else (len(text), [])


def echoed(text: str, names) -> bool:
    """Whether a finished answer is nothing but calls that repeat calls answered in this turn (`Names.answered`),
    whitespace aside: read as content, it says nothing the client can use."""
    if not getattr(names, "answered", None):
        return False
    at, calls = _split(text, names)
    repeats = [c for c in calls if _key(c.name, c.arguments) in names.answered]
    return bool(calls) and len(repeats) == len(calls) and not text[:at].strip()


def parse(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a finished answer; no calls: the text unchanged as content. A call names one of the
    request's tools with arguments that parse as a JSON object, and nothing but calls follows it; text that only
    mentions a function is content."""
    at, calls = find_calls(text, names)
    return (text[:at].strip(), calls) if calls else (text, [])


def answer_calls(body: dict, fin, names: set[str]) -> None:
    """A whole chat answer (chat.completion) with its tool calls read out of the text."""
    content, calls = parse(fin.text, names)
    if not calls:
        return
    choice = body["choices"][0]
    choice["message"] = {"role": "assistant", "content": content or None,
                         "tool_calls": [c.openai() for c in calls]}
    choice["finish_reason"] = finish_reason(fin.finish_reason, calls)


def finish_reason(finish: str, calls: list[ToolCall]) -> str:
    """An answer's finish_reason: "tool_calls" when it ended on its own after calls; "length" when the token limit
    cut it (its whole calls come back, one it cut off does not, and the client learns that more may have been
    coming) and "cancelled" stay."""
    return "tool_calls" if calls and finish not in ("length", "cancelled") else finish
