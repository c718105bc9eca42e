"""Chat templates: the model's own Jinja template, rendered in jinja2's immutable sandbox.

The environment matches Hugging Face transformers' (trim_blocks, lstrip_blocks, loopcontrols, a `tojson` that keeps
non-ASCII, `raise_exception`, `strftime_now`, `{% generation %}`), so a template that works there works here.

A rendered prompt comes back as segments: template markup and message content. Only markup may hold special
tokens; content is tokenized as plain text, so `<|im_end|>` typed or piped by a user stays text and cannot
close the user's turn (see llama/tokens.py Tokens.tokenize_segments).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, Sequence

from localspec.errors import LocalspecError, UsageError


class ChatTemplateError(LocalspecError):
    """A chat template that does not parse, fails while rendering, or reaches outside the sandbox.
    Exit status 1: the command was fine, the template (the model's data or the --chat-template file) is not."""


@dataclass(frozen=True)
class Segment:
    text: str
    content: bool  # True: a message's text (plain text); False: template markup (special tokens allowed)


def read_template_file(path: str | Path) -> str:
    """The text of a --chat-template FILE (a usage error when it cannot be read)."""
    p = Path(path).expanduser()
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"chat template file not found: {path}") from None
    except UnicodeDecodeError:
        raise UsageError(f"chat template file is not UTF-8 text: {path}") from None
    except OSError as exc:
        raise UsageError(f"cannot read chat template file {path}: {exc.strerror or exc}") from None


def plain_segments(messages: Sequence[dict], add_generation_prompt: bool = True,
                   tools: Sequence[dict] | None = None) -> list[Segment]:
    """The fallback for a model without a template: a 'role: content' transcript (tools and tool calls as JSON
    lines, as text)."""
    out: list[Segment] = []
    if tools:
        out += [Segment("tools: ", False), Segment(json.dumps(list(tools), ensure_ascii=False), True),
                Segment("\n", False)]
    for m in messages:
        out += [Segment(f"{m['role']}: ", False), Segment(m.get("content") or "", True), Segment("\n", False)]
        for call in m.get("tool_calls") or ():
            out += [Segment("tool call: ", False), Segment(json.dumps(call.get("function", call), ensure_ascii=False),
                                                           True), Segment("\n", False)]
    if add_generation_prompt:
        out.append(Segment("assistant:", False))
    return out


def _environment():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` (marks assistant text for training in transformers): renders
        its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class ChatTemplate:
    """A parsed template. `origin` names it in errors ("the chat template of model.gguf")."""

    def __init__(self, source: str, *, origin: str, bos_token: str = "", eos_token: str = "") -> None:
        import jinja2

        self.origin = origin
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._tmpl = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"{origin} cannot be parsed: {_one_line(exc.message)} (line {exc.lineno})") from None
        except Exception as exc:
            raise ChatTemplateError(f"{origin} cannot be parsed: {type(exc).__name__}: {_one_line(exc)}") from None

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True,
               tools: Sequence[dict] | None = None) -> str:
        from jinja2.exceptions import SecurityError, TemplateError

        try:
            return self._tmpl.render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, tools=list(tools) if tools else None,
            )
        except SecurityError as exc:
            raise ChatTemplateError(f"{self.origin} tried to reach outside the sandbox: {_one_line(exc)}") from None
        except TemplateError as exc:  # raise_exception(...) and undefined-variable errors
            raise ChatTemplateError(f"{self.origin} refused the messages: {_one_line(exc.message or exc)}") from None
        except Exception as exc:
            raise ChatTemplateError(f"{self.origin} failed: {type(exc).__name__}: {_one_line(exc)}") from None

    def segments(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                 tools: Sequence[dict] | None = None, *,
                 plain: Callable[[str], bool] | None = None) -> list[Segment]:
        """The rendered prompt split into markup and plain text. `tools`: the function tools (OpenAI's shape), given
        to the template as transformers does.

        Plain text is every message's content, and every other string of the request (in `tools`, tool calls and
        their arguments, names, ids; dict keys included) for which `plain(s)` is true: the model's test "holds the
        text of a control token" (Model.has_control_text). Such strings reach the template from whoever wrote the
        tool definition or the tool result, so they must never become special tokens. The default test, for
        callers without a model, takes any string holding `<`, `>`, `[`, `]` or `|`. Other strings stay as they
        are, so templates that compare them (`tool.type == "function"`) still work.

        The template is rendered twice: with the real values (the text the model expects) and with each plain
        string replaced by a unique placeholder (which shows where the markup is). The real text is then matched
        piece by piece: markup, then the string as the template printed it (as-is, stripped as `| trim` does, JSON-
        escaped as `| tojson` does, or as Python's repr as `| string` does), then markup... A string can never be
        taken for markup: every piece is checked in order against the real text. If the template transformed a
        string in a way not recognised here, the placeholders are filled with the string as-is (JSON-escaped
        between quotes); the prompt then differs from the template only in that transformation.
        """
        real = self.render(messages, add_generation_prompt, tools)
        test = plain or _may_hold_markup
        nonce = secrets.token_hex(8)
        while nonce in repr((messages, tools)):  # pragma: no cover - 2^-64
            nonce = secrets.token_hex(8)
        values: list[str] = []

        def mark(s: str) -> str:
            values.append(s)
            return f"\ue000{nonce}{len(values) - 1}\ue001"

        def walk(x):
            if isinstance(x, str):
                return mark(x) if x and test(x) else x
            if isinstance(x, dict):
                return {(mark(k) if isinstance(k, str) and k and test(k) else k): walk(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return [walk(v) for v in x]
            return x

        masked = []
        for m in messages:
            mm = {k: (v if k in ("role", "content") else walk(v)) for k, v in m.items()}
            c = m.get("content")
            if isinstance(c, str) and c:  # "" stays "": `{% if message.content %}` holds
                mm["content"] = mark(c)
            masked.append(mm)
        masked_tools = walk(list(tools)) if tools else tools
        try:
            skeleton = self.render(masked, add_generation_prompt, masked_tools)
        except ChatTemplateError as exc:  # it accepts the real values but not placeholders: it parses them
            raise ChatTemplateError(f"{self.origin} cannot be split into markup and message text ({exc})") from None
        parts = re.split(f"(?:\ue000|\\\\ue000){nonce}(\\d+)(?:\ue001|\\\\ue001)", skeleton)
        markup, order = parts[0::2], [int(x) for x in parts[1::2]]
        aligned = _align(real, markup, [values[i] for i in order])
        if aligned is not None:
            return aligned
        out = [Segment(markup[0], False)]
        for j, (i, m) in enumerate(zip(order, markup[1:])):
            quoted = markup[j].endswith('"') and m.startswith('"')
            out += [Segment(_json_inner(values[i]) if quoted else values[i], True), Segment(m, False)]
        return [s for s in out if s.text]


def _may_hold_markup(s: str) -> bool:
    """Whether a string could hold a control token's text, for callers that cannot ask the model: control tokens
    are written in angle or square brackets (`<|im_end|>`, `</s>`, `[INST]`, `<start_of_turn>`)."""
    return any(c in s for c in "<>[]|")


def _json_inner(s: str, ascii_only: bool = False) -> str:
    return json.dumps(s, ensure_ascii=ascii_only)[1:-1]


def _variants(content: str) -> list[str]:
    """How templates commonly print a string: as-is, `| trim`, `.strip()`, `.lstrip()`, `.rstrip()`, after a
    reasoning block (`content.split('</think>')[-1].lstrip('\\n')`), inside `| tojson` (with or without
    ensure_ascii) and inside `| string` of a list or dict (Python's repr)."""
    out = [content, content.strip(), content.lstrip(), content.rstrip()]
    if "</think>" in content:
        after = content.split("</think>")[-1]
        out += [after, after.lstrip("\n"), after.strip()]
    out += [_json_inner(content), _json_inner(content, ascii_only=True), repr(content)[1:-1],
            _json_inner(content.strip())]
    seen: set[str] = set()
    return [v for v in out if not (v in seen or seen.add(v))]


def _align(real: str, markup: list[str], contents: list[str]) -> list[Segment] | None:
    """`real` as markup[0], contents[0] (one of its variants), markup[1], ... exactly, or None. Where two variants
    both fit (a string with spaces at its ends), the later pieces decide: a depth-first search that tries each
    (piece, position) once."""
    if not real.startswith(markup[0]):
        return None
    failed: set[tuple[int, int]] = set()
    # iterative (a long conversation holds more strings than Python's recursion limit): one frame per string,
    # each frame (j, position, variants left to try)
    stack: list[tuple[int, int, list[str]]] = [(0, len(markup[0]), _variants(contents[0]) if contents else [])]
    chosen: list[str] = []
    while stack:
        j, pos, left = stack[-1]
        if j == len(contents):
            if pos == len(real):
                break
            stack.pop()
            if chosen:
                chosen.pop()
            continue
        nxt = markup[j + 1]
        while left and not (real.startswith(left[0] + nxt, pos) and (j + 1, pos + len(left[0]) + len(nxt))
                            not in failed):
            left.pop(0)
        if not left:
            failed.add((j, pos))
            stack.pop()
            if chosen:
                chosen.pop()
            continue
        v = left.pop(0)
        chosen.append(v)
        npos = pos + len(v) + len(nxt)
        stack.append((j + 1, npos, _variants(contents[j + 1]) if j + 1 < len(contents) else []))
    else:
        return None
    out = [Segment(markup[0], False)]
    for v, nxt in zip(chosen, markup[1:]):
        out += [Segment(v, True), Segment(nxt, False)]
    return [s for s in out if s.text]
