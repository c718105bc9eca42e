"""Tool calling, the OpenAI way: the request's `tools` and the conversation's calls and results go to the chat
template (transformers' context), and the model's answer is read back into `tool_calls`.

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
agent would call again forever. An answer that is nothing but such echoes (`echoed`) says nothing, so the turn is
generated once more as under tool_choice none, and that answer is the request's (`Retry`). With parallel_tool_calls
false an answer holds one call (`reading`).

A template that prints no tools at all is given them in the system message with the Hermes format (`for_template`),
and calls and results in the conversation are written in that format.

tool_choice "auto": a lazy grammar (server/tool_grammar.py `auto_grammar`, server/grammar.py Lazy) lets the model
write freely until its answer starts a call (the format's marker, or a fenced / bare JSON object up to the name of
one of the tools); from there the call follows the tools' schemas. "required" or a named function: the answer is
decoded under a grammar (`choice_grammar`): one or more calls of the allowed tools in the format the chat template
uses.

Streaming (`ToolStream`): text is passed on until a call could be beginning; from there it is held back while it
may still be one and, at the end, sent as `tool_calls` deltas, the arguments in pieces (or as content when it was
not a call after all). An echo that is the whole answer is held back whole, so the answer generated again takes its
place unseen (`Again`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
import weakref
from collections import Counter
from dataclasses import dataclass
from itertools import zip_longest

from localspec.core.generation import Finished
from localspec.server.openai import MAX_DEPTH, APIError, too_deep

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
        place = f"{where}[{j}].function.arguments" if where.endswith("tool_calls") else f"{where}.arguments"
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
                deep = too_deep(args)
            except ValueError:
                deep = False  # left as text: the template prints what it was given
            except RecursionError:
                deep = True
            if deep:  # the template and the walks over the prompt recurse per level
                raise APIError(400, f"{place} is nested more than {MAX_DEPTH} levels deep",
                               param=where.split(".")[0].split("[")[0])
        out.append({"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


# ------------------------------------------------------------------ templates that show no tools
# What a model whose template prints no tools is told (the Hermes / Qwen wording; its calls are read, and held to
# the schemas, as under a Hermes template). Unlike llama.cpp's generic format, which makes every answer a JSON
# object ({"response": ...} or {"tool_call": ...}), the answer stays free text until the model starts a call.
TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML \
tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
_PROBE = "localspec_probe"


@dataclass(frozen=True)
class Support:
    """What a chat template prints: the request's tools, an assistant turn's calls, a tool turn's result, a system
    message."""
    tools: bool
    calls: bool
    results: bool
    system: bool


_SUPPORT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def support(tmpl) -> Support:
    """What `tmpl` (a ChatTemplate) prints, found once by rendering a conversation with marked names."""
    got = _SUPPORT.get(tmpl)
    if got is not None:
        return got

    def shows(msgs, needle, tools=None) -> bool:
        try:
            return needle in tmpl.render(msgs, True, tools)
        except Exception:  # a template that refuses the role or the fields: it does not print them
            return False

    user = {"role": "user", "content": "hi"}
    tool = {"type": "function", "function": {"name": _PROBE + "_tool", "description": "",
                                             "parameters": {"type": "object", "properties": {}}}}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": _PROBE + "_call", "arguments": {}}}]}
    result = {"role": "tool", "tool_call_id": "call_1", "name": _PROBE + "_call", "content": _PROBE + "_result"}
    got = _SUPPORT[tmpl] = Support(
        tools=shows([user], _PROBE + "_tool", [tool]), calls=shows([user, call], _PROBE + "_call", [tool]),
        results=shows([user, call, result], _PROBE + "_result", [tool]),
        system=shows([{"role": "system", "content": _PROBE + "_system"}, user], _PROBE + "_system"))
    return got


def hermes_calls(calls: list[dict]) -> str:
    """An assistant turn's calls (template_tool_calls' form) written as Hermes calls."""
    return "\n".join(f"{HERMES_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                     "arguments": c["function"]["arguments"]}, ensure_ascii=False)
                     + f"\n{HERMES_CLOSE}" for c in calls)


def for_template(msgs: list[dict], tools: list[dict] | None, tmpl) -> tuple[list[dict], bool]:
    """(the messages as `tmpl` can show them, whether the model is taught the Hermes call format here). A template
    that prints no tools gets them in the system message (TOOLS_PROMPT; in the first user message when it takes no
    system message); calls and results it does not print (all of them, when it prints no tools) are written into
    the text as Hermes calls and `<tool_response>` blocks (the results as a user turn), as the model was told."""
    if tmpl is None or (tools is None and not any(m.get("tool_calls") or m["role"] == "tool" for m in msgs)):
        return msgs, False
    sup = support(tmpl)
    calls, results = sup.calls and sup.tools, sup.results and sup.tools  # no tool format: all of it as Hermes
    out: list[dict] = []
    for m in msgs:
        if m["role"] == "assistant" and m.get("tool_calls") and not calls:
            text = "\n".join(x for x in (m.get("content") or "", hermes_calls(m["tool_calls"])) if x)
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool" and not results:
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("from_tool"):  # results of one turn's calls: one user turn
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block, "from_tool": True})
        else:
            out.append(m)
    out = [{k: v for k, v in m.items() if k != "from_tool"} for m in out]
    taught = tools is not None and not sup.tools
    if taught:
        note = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{note}" if out[0]["content"] else note}
        elif sup.system:
            out.insert(0, {"role": "system", "content": note})
        else:
            i = next((j for j, m in enumerate(out) if m["role"] == "user"), None)
            if i is None:
                out.insert(0, {"role": "user", "content": note})
            else:
                out[i] = {**out[i], "content": f"{note}\n\n{out[i]['content']}"}
    return out, taught


# ------------------------------------------------------------------ the answer side
# A fenced block a call may sit in: ```json, ``` or ```tool_call, up to its closing fence (or the end of the answer:
# a stop string or the token limit may cut the closing fence off).
FENCE_LANGS = ("", "json", "tool_call")
_FENCE = re.compile(r"```([A-Za-z_]*)[ \t]*\r?\n(.*?)(?:```|\Z)", re.S)
# where a call written without markers may start: a fence, a JSON object or array whose first key is coming
_START = re.compile(r"```|<\|python_tag\|>|[\[{]\s*[{\"]|[\[{]\s*\Z")
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
    for m in _START.finditer(text):
        calls = _tail_calls(text[m.start():], names, cut=True)
        if calls:
            return m.start(), calls
    return len(text), []


def _read(text: str, names: set[str]) -> tuple[int, list[ToolCall]]:
    """_split, then the calls the answer makes (`_kept`): (len(text), []) when none is left."""
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
    at, calls = _read(text, names)
    return (text[:at].strip(), calls) if calls else (text, [])


def _could_be_call(s: str, names: set[str]) -> bool | None:
    """Whether `s` (from a possible call start on) may still turn out to be a call: True (it names one of the
    tools, or starts with a marker: held to the end), None (not decided yet), False (it is not a call)."""
    if s.startswith(MARKERS):
        return True
    if s.startswith("```"):
        m = re.match(r"```([A-Za-z_]*)([ \t]*\r?\n)?", s)
        lang = m.group(1).lower()
        if m.group(2) is None:  # the language is still being written
            return None if m.end() == len(s) and any(x.startswith(lang) for x in FENCE_LANGS) else False
        if lang not in FENCE_LANGS:
            return False
        s = s[m.end():].lstrip()
        if not s:
            return None
    m = re.match(r'\[?\s*\{\{?\s*("(?:[^"\\]|\\.)*)("?)', s)
    if m is None:
        return None if re.fullmatch(r"\[?\s*\{?\{?\s*", s) else False
    key, closed = m.group(1)[1:], m.group(2)
    if not closed:
        return None if any(k.startswith(key) for k in CALL_KEYS) else False
    if key not in CALL_KEYS:
        return False
    if key != "name":
        return None  # decided at the end
    rest = s[m.end():]
    n = re.match(r'\s*(:\s*("(?:[^"\\]|\\.)*)?("?))?', rest)
    if n.group(2) is None:
        return None if n.end() == len(rest) else False
    name, done = n.group(2)[1:], n.group(3)
    if done:
        return name in names or not names
    return None if any(x.startswith(name) for x in names) or not names else False


class ToolStream:
    """Splits a streamed answer: `feed(text)` returns the text that is surely content; from a possible call start on
    (a marker, a fence, a JSON object) text is held while it may still be a call of one of the tools, and, once it
    names one, until `end()`, which returns (content still to send, calls)."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.sent = ""  # content passed on
        self.held = ""  # text not passed on yet
        self.holding = False  # a call was recognised: everything from there waits for the end

    def feed(self, text: str) -> str:
        self.held += text
        if self.holding:
            return ""
        pos = 0
        while True:
            m = self._next_start(pos)
            if m is None:
                keep = self._partial_tail()
                cut = max(pos, len(self.held) - keep)
                break
            verdict = _could_be_call(self.held[m:], self.names)
            if verdict is False:
                pos = m + 1
                continue
            cut = m
            self.holding = verdict is True
            break
        while cut > 0 and self.held[cut - 1].isspace():  # whitespace waits: before calls it is no content
            cut -= 1
        out, self.held = self.held[:cut], self.held[cut:]
        self.sent += out
        return out

    def _next_start(self, pos: int) -> int | None:
        found = [i for i in (self.held.find(mk, pos) for mk in MARKERS) if i >= 0]
        m = _START.search(self.held, pos)
        if m is not None:
            found.append(m.start())
        return min(found) if found else None

    def _partial_tail(self) -> int:
        """How many characters at the end may begin a call start and wait for the next piece."""
        keep = 0
        for mk in (*MARKERS, "```"):
            for n in range(min(len(mk) - 1, len(self.held)), 0, -1):
                if self.held.endswith(mk[:n]):
                    keep = max(keep, n)
                    break
        m = re.search(r"[\[{]\s*\{?\s*\Z", self.held)
        if m is not None:
            keep = max(keep, len(self.held) - m.start())
        return keep

    def again(self) -> None:
        """The answer is generated again (`Again`): what was held, an echo that was never sent, is dropped."""
        self.sent, self.held, self.holding = "", "", False

    def end(self) -> tuple[str, list[ToolCall]]:
        text = self.sent + self.held
        at, calls = _read(text, self.names)
        if calls:  # the content before the calls that was held back, without the calls
            return text[len(self.sent):at].rstrip() if at > len(self.sent) else "", calls
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
    choice["finish_reason"] = finish_reason(fin.finish_reason, calls)


def finish_reason(finish: str, calls: list[ToolCall]) -> str:
    """An answer's finish_reason: "tool_calls" when it ended on its own after calls; "length" when the token limit
    cut it (its whole calls come back, one it cut off does not, and the client learns that more may have been
    coming) and "cancelled" stay."""
    return "tool_calls" if calls and finish not in ("length", "cancelled") else finish


_PIECES = re.compile(r'"?[^"]{0,11}')


def argument_pieces(arguments: str) -> list[str]:
    """A call's arguments in the small pieces OpenAI streams them in (about a token each: a dozen characters at
    most); joined, the arguments."""
    return [p for p in _PIECES.findall(arguments) if p]


def call_deltas(call: ToolCall, index: int, role: bool = False) -> list[dict]:
    """A call as OpenAI streams it: the id and name with empty arguments (with the assistant role when it opens the
    answer, and content null), then the arguments in pieces."""
    first = {"content": None, "tool_calls": [{"index": index, "id": call.id, "type": "function",
                                              "function": {"name": call.name, "arguments": ""}}]}
    if role:
        first = {"role": "assistant", **first}
    return [first] + [{"tool_calls": [{"index": index, "function": {"arguments": piece}}]}
                      for piece in argument_pieces(call.arguments)]


# ------------------------------------------------------------------ an answer that only echoes answered calls
RETRIED = "the answer repeated a call already answered in this turn; answered again without tool calls"
# the figures of a generation that add up over two (usage, the speculation counts, the times)
_SUMMED = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens", "drafted", "accepted", "target_passes",
           "drafting_steps", "plain_s", "prompt_s", "draft_s", "verify_s", "elapsed_s", "restores", "replayed_tokens",
           "rs_rollbacks", "rollback_s", "draft_restores", "draft_replayed_tokens")


class Again:
    """The event between the two generations of a retried answer (`Retry`): a ToolStream drops what it held."""


def retried(first: Finished, second: Finished) -> Finished:
    """The answer of a retried request: the second generation's, with the figures of both (usage counts both
    prompts and both answers; the first token came after the whole first generation) and `retried`, the note
    the `localspec` object carries."""
    a, b = first.stats, second.stats
    stats = dataclasses.replace(
        b, **{k: getattr(a, k) + getattr(b, k) for k in _SUMMED}, ttft_s=a.elapsed_s + b.ttft_s,
        **{k: Counter(getattr(a, k)) + Counter(getattr(b, k))
           for k in ("k_used", "method_used", "drafted_by", "accepted_by")},
        **{k: [x + y for x, y in zip_longest(getattr(a, k), getattr(b, k), fillvalue=0)]
           for k in ("drafted_at", "accepted_at")})
    stats.retried = RETRIED
    return Finished(second.text, second.tokens, second.finish_reason, stats)


class Retry:
    """A generation's events, read as a server/queue.py Job's (`events.get()`, `cancel`, `n_prompt`, `checked`),
    for an answer under tool_choice auto: when it is nothing but echoes of calls answered in this turn (`echoed`),
    `again()` (a coroutine: the turn as under tool_choice none, its job submitted; None when it cannot start, and
    the echo stands as content) starts a second generation, whose events follow an `Again`, its Finished
    `retried`. Nothing of the echo was sent: a ToolStream holds a call from its start to the end."""

    def __init__(self, job, names, again) -> None:
        self.job, self.names, self.again, self.first = job, names, again, None
        self.events, self.n_prompt, self.checked = self, job.n_prompt, job.checked

    @property
    def cancel(self):
        return self.job.cancel

    async def get(self):
        ev = await self.job.events.get()
        if isinstance(ev, Finished):
            if self.first is not None:
                return retried(self.first, ev)
            if ev.finish_reason != "cancelled" and echoed(ev.text, self.names):
                job = await self.again()
                if job is not None:
                    self.first, self.job = ev, job
                    return Again()
        return ev
