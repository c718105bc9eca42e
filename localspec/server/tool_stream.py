"""A streamed answer with tools, the OpenAI way: text is passed on until a call could be beginning; from there it
is held back while it may still be one (`ToolStream`) and, at the end, sent as `tool_calls` deltas, the arguments
in pieces (`call_deltas`; or as content when it was not a call after all). An echo that is the whole answer is held
back whole, so the answer generated again takes its place unseen (server/tool_retry.py `Again`).
"""

from __future__ import annotations

import re

from localspec.server.tool_calls import CALL_KEYS, CALL_START, FENCE_LANGS, MARKERS, ToolCall, find_calls


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
        m = CALL_START.search(self.held, pos)
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
        at, calls = find_calls(text, self.names)
        if calls:  # the content before the calls that was held back, without the calls
            return text[len(self.sent):at].rstrip() if at > len(self.sent) else "", calls
        rest, self.held = self.held, ""
        return rest, []


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
