"""A chat as Markdown or JSON, for chat's /save and `localspec history export`."""

from __future__ import annotations

import json
import re

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def open_fence(text: str) -> str | None:
    """The fence (e.g. "```") a code block in `text` opened and never closed, or None (CommonMark rules: a
    fence is closed by a line of the same character, at least as long, with nothing after it)."""
    fence: str | None = None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if not m:
            continue
        marks, rest = m.group(1), m.group(2)
        if fence is None:
            if marks[0] == "`" and "`" in rest:
                continue  # not a fence: a backtick fence's info string has no backticks
            fence = marks
        elif marks[0] == fence[0] and len(marks) >= len(fence) and not rest.strip():
            fence = None
    return fence


def close_fences(text: str) -> str:
    """`text` with a closing fence appended when a code block was left open (an answer stopped or cut at the
    token limit), so what follows it in a file does not render as code."""
    fence = open_fence(text)
    if fence is None:
        return text
    return text + ("" if text.endswith("\n") else "\n") + fence


def to_markdown(title: str, messages: list[dict], model: str | None = None) -> str:
    parts = [f"# {title}\n"]
    if model:
        parts.append(f"model: {model}\n")
    for m in messages:
        body = close_fences(m["content"])
        state = m.get("state")
        mark = f" ({state})" if state in ("stopped", "interrupted", "streaming", "error") else ""
        parts.append(f"## {m['role']}{mark}\n\n{body}\n")
    return "\n".join(parts)


def to_json(data: dict) -> str:
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"
