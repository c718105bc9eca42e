"""`POST /v1/messages` and `POST /v1/messages/count_tokens` read: Anthropic's Messages API as the `anthropic`
package and Claude Code send it, read into the chat request's form, so that it runs on the same generation as the
OpenAI endpoints.

A request is read into chat's form (`messages_of`, `chat_tools`): `system` (a string or text blocks) is the system
message; a user turn's `tool_result` blocks are tool messages (in order, before the turn's text), an assistant
turn's `tool_use` blocks its `tool_calls` (the input as the arguments object); `thinking` and `redacted_thinking`
blocks a client sends back are dropped; images and documents are a 400. `tool_choice` any is chat's required, a
named tool is a named function, `disable_parallel_tool_use` is parallel_tool_calls false; `stop_sequences` are the
stop strings; `output_config.format` is the answer's JSON Schema (`output_format`). From there it is the chat
request's path: tools, grammars, speculation, batching, cancellation, metrics and the guard. The answer:
server/anthropic_answer.py; errors in Anthropic's shape: server/anthropic_errors.py."""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from localspec.server.config import MAX_STOPS
from localspec.server.openai import APIError
from localspec.server.schemas import Common
from localspec.server.tool_template import template_tool_calls

DROPPED = ("thinking", "redacted_thinking")  # blocks a client sends back that say nothing to this model
NOT_TEXT = ("image", "document")


class MessagesRequest(Common):
    messages: Any = None
    system: Any = None
    stop_sequences: Any = None
    top_k: Optional[int] = None
    metadata: Any = None  # accepted; not used
    tools: Any = None
    tool_choice: Any = None
    thinking: Any = None  # accepted; no thinking blocks are produced
    output_config: Any = None  # {"format": {"type": "json_schema", "schema": {...}}} (structured output)
    output_format: Any = None  # the same format, as the stream helper's earlier name sends it


def _refused(kind: str, where: str, param: str) -> APIError:
    if kind in NOT_TEXT:
        return APIError(400, f"{where}: {kind} blocks are not supported: this server runs a text-only model",
                        param=param)
    return APIError(400, f"{where}: content blocks of type {kind!r} are not supported here", param=param)


def _texts(content, where: str, param: str) -> str:
    """The text of a string or a list of text blocks (a system prompt, a tool result)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text blocks", param=param)
    out = []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind != "text":
            raise _refused(kind, f"{where}[{j}]", param) if kind else \
                APIError(400, f"{where}[{j}] must be a content block with a type", param=param)
        if not isinstance(b.get("text"), str):
            raise APIError(400, f"{where}[{j}].text must be a string", param=param)
        out.append(b["text"])
    return "\n".join(out)


def check(req: MessagesRequest) -> None:
    """Anthropic's own checks of the fields chat does not have, and the request made ready for the chat path:
    its stop strings are `stop_sequences`, it has one answer."""
    if req.max_tokens is None:
        raise APIError(400, "max_tokens: Field required", param="max_tokens")
    if req.max_tokens < 1:
        raise APIError(400, f"max_tokens must be >= 1, got {req.max_tokens}", param="max_tokens")
    if req.temperature is not None and not 0 <= req.temperature <= 1:
        raise APIError(400, f"temperature must be between 0 and 1, got {req.temperature}", param="temperature")
    if req.top_k is not None and req.top_k < 0:
        raise APIError(400, f"top_k must be >= 0, got {req.top_k}", param="top_k")
    s = req.stop_sequences
    if s is not None and not (isinstance(s, list) and all(isinstance(x, str) for x in s)):
        raise APIError(400, "stop_sequences must be a list of strings", param="stop_sequences")
    if s is not None and len(s) > MAX_STOPS:
        raise APIError(400, f"stop_sequences takes at most {MAX_STOPS} strings", param="stop_sequences")
    # chat-only fields a Messages request does not have: not read from it
    req.stop, req.n, req.response_format, req.logit_bias, req.stream_options = s, None, None, None, None
    req.max_completion_tokens = None


def user_turn(out: list[dict], text: str) -> None:
    """A user turn's text after `out`: joined to a user turn just before it (consecutive turns of a role are one
    turn, as upstream)."""
    if out and out[-1]["role"] == "user":
        out[-1]["content"] += "\n\n" + text
    else:
        out.append({"role": "user", "content": text})


BILLING_LINE = "x-anthropic-billing-header:"


def _without_billing_line(system):
    """`system` without Claude Code's `x-anthropic-billing-header: ...; cch=XXXXX;` line: its hash changes with every
    request, and at the prompt's start it would make every request's prompt new to the KV cache and the prompt
    states. It tells the model nothing (Anthropic's own API reads it as a header)."""
    if isinstance(system, str):
        first, _, rest = system.partition("\n")
        return rest if first.startswith(BILLING_LINE) else system
    if isinstance(system, list):
        return [b for b in system if not (isinstance(b, dict) and b.get("type") == "text"
                                          and str(b.get("text", "")).startswith(BILLING_LINE))]
    return system


def messages_of(req: MessagesRequest) -> list[dict]:
    """The chat messages of a Messages request (see the module doc). 400 naming the field for what this server
    cannot read."""
    check(req)
    out = []
    system = _texts(_without_billing_line(req.system), "system", "system")
    if system:
        out.append({"role": "system", "content": system})
    if not isinstance(req.messages, list) or not req.messages:
        raise APIError(400, "messages: a non-empty list of messages is required", param="messages")
    names: dict[str, str] = {}  # tool_use id -> the tool's name (templates print it with the result)
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant", "system"):
            raise APIError(400, f"{where}.role must be \"user\" or \"assistant\", got {role!r}",
                           param=f"{where}.role")
        if role == "system":  # instructions among the turns (Claude Code sends them)
            said = _texts(m.get("content"), f"{where}.content", f"{where}.content")
            if all(x["role"] == "system" for x in out):  # before any turn: the system prompt's
                if out:
                    out[0]["content"] += "\n\n" + said
                else:
                    out.append({"role": "system", "content": said})
            else:  # later: user text at its place (templates take a system message first only)
                user_turn(out, said)
            continue
        content = m.get("content")
        if isinstance(content, str):
            blocks = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            blocks = content
        else:
            raise APIError(400, f"{where}.content must be a string or a list of content blocks",
                           param=f"{where}.content")
        text: list[str] = []
        calls: list[dict] = []

        def flush_user():
            if text:
                user_turn(out, "\n".join(text))
                text.clear()

        for j, b in enumerate(blocks):
            at = f"{where}.content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind in DROPPED:
                continue
            elif kind == "tool_use" and role == "assistant":
                if not (isinstance(b.get("id"), str) and isinstance(b.get("name"), str)):
                    raise APIError(400, f"{at}: a tool_use block needs id and name", param=f"{where}.content")
                args = b.get("input", {})
                if not isinstance(args, dict):
                    raise APIError(400, f"{at}.input must be an object", param=f"{where}.content")
                calls += template_tool_calls([{"id": b["id"], "type": "function", "function": {
                    "name": b["name"], "arguments": json.dumps(args, ensure_ascii=False)}}], at)
                names[b["id"]] = b["name"]
            elif kind == "tool_result" and role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise APIError(400, f"{at}: a tool_result block needs tool_use_id", param=f"{where}.content")
                flush_user()
                result = _texts(b.get("content"), f"{at}.content", f"{where}.content")
                if b.get("is_error"):
                    result = f"Error: {result}"
                msg = {"role": "tool", "tool_call_id": b["tool_use_id"], "content": result}
                if b["tool_use_id"] in names:
                    msg["name"] = names[b["tool_use_id"]]
                out.append(msg)
            elif kind in ("tool_use", "tool_result"):
                raise APIError(400, f"{at}: a {kind} block belongs in a{'n assistant' if kind == 'tool_use' else ' user'}"
                                    " turn", param=f"{where}.content")
            elif kind == "text":
                raise APIError(400, f"{at}.text must be a string", param=f"{where}.content")
            else:
                raise _refused(kind, at, f"{where}.content") if kind else \
                    APIError(400, f"{at} must be a content block with a type", param=f"{where}.content")
        if role == "user":
            flush_user()
        else:
            msg = {"role": "assistant", "content": "\n".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[[^\]]*\])")
MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema


def _without(schema, keys: set):
    """`schema` without the keywords `keys`, wherever a schema sits (a property named so stays)."""
    if isinstance(schema, list):
        return [_without(x, keys) for x in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: ({n: _without(v, keys) for n, v in schema[k].items()} if k in MAPS and isinstance(schema[k], dict)
                else _without(schema[k], keys)) for k in schema if k not in keys}


def enforceable(schema: dict, i: int) -> dict:
    """A tool's input_schema without the keywords the grammar cannot enforce (llguidance's unimplemented ones,
    such as `propertyNames`, which Claude Code's tools use): each only narrows what a value may be, so the input is
    held to the rest of the schema. Any other problem is a 400 naming tools[i]."""
    from localspec.server.grammar import usable_schema
    from localspec.server.json_schema import closed

    for _ in range(8):
        try:
            usable_schema(closed(schema), f"tools[{i}].input_schema", f"tools[{i}]")
            return schema
        except APIError as exc:
            m = _UNIMPLEMENTED.search(exc.message)
            if m is None:
                raise
            try:
                keys = {k for k in json.loads(m.group(1)) if isinstance(k, str)}
            except ValueError:
                raise exc from None
            if not keys:
                raise
            schema = _without(schema, keys)
    return schema


def chat_tools(req: MessagesRequest) -> tuple[list[dict] | None, Any, bool]:
    """(the tools in chat's form, chat's tool_choice, parallel_tool_calls). Custom tools with `input_schema`;
    Anthropic's server tools (web search, code execution ...) are a 400 naming tools[i]."""
    tools = req.tools
    if tools is not None and not isinstance(tools, list):
        raise APIError(400, "tools must be a list of tools", param="tools")
    out = None
    if tools:
        out = []
        for i, t in enumerate(tools):
            kind = t.get("type", "custom") if isinstance(t, dict) else None
            if kind not in ("custom", None) or not isinstance(t.get("name"), str) or not t["name"]:
                raise APIError(400, f"tools[{i}]: only custom tools ({{\"name\", \"description\", \"input_schema\"}})"
                                    f" are supported here" + (f", got type {kind!r}" if kind != "custom" else ""),
                               param=f"tools[{i}]")
            schema = t.get("input_schema", {"type": "object", "properties": {}})
            if not isinstance(schema, dict):
                raise APIError(400, f"tools[{i}].input_schema must be a JSON Schema object", param=f"tools[{i}]")
            f = {"name": t["name"], "parameters": enforceable(schema, i)}
            if isinstance(t.get("description"), str):
                f["description"] = t["description"]
            out.append({"type": "function", "function": f})
    c = req.tool_choice
    if c is None:
        return out, None, True
    if not isinstance(c, dict) or c.get("type") not in ("auto", "any", "tool", "none"):
        raise APIError(400, "tool_choice must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}",
                       param="tool_choice")
    if c["type"] == "tool" and not isinstance(c.get("name"), str):
        raise APIError(400, "tool_choice of type \"tool\" needs the tool's name", param="tool_choice")
    choice = {"auto": "auto", "any": "required", "none": "none"}.get(c["type"]) or \
        {"type": "function", "function": {"name": c["name"]}}
    return out, choice, not c.get("disable_parallel_tool_use")


def output_format(req: MessagesRequest) -> tuple[dict | None, str | None]:
    """(the JSON Schema `output_config.format` asks the answer to follow, its grammar); (None, None): free text.
    Decoded under it as chat's response_format (strict semantics); 400 naming output_config.format."""
    from localspec.server.grammar import usable_schema
    from localspec.server.json_schema import closed

    where = "output_config.format"
    oc = req.output_config
    if oc is not None and not isinstance(oc, dict):
        raise APIError(400, "output_config must be an object", param="output_config")
    fmt = (oc or {}).get("format")
    if fmt is None and req.output_format is not None:
        fmt, where = req.output_format, "output_format"
    if fmt is None:
        return None, None
    if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict)):
        raise APIError(400, f"{where} must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}", param=where)
    return usable_schema(closed(fmt["schema"]), where, where)
