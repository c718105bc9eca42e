"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API as the `anthropic` package and
Claude Code send it, over the same generation as the OpenAI endpoints.

A request is read into chat's form (`messages_of`, `chat_tools`): `system` (a string or text blocks) is the system
message; a user turn's `tool_result` blocks are tool messages (in order, before the turn's text), an assistant
turn's `tool_use` blocks its `tool_calls` (the input as the arguments object); `thinking` and `redacted_thinking`
blocks a client sends back are dropped; images and documents are a 400. `tool_choice` any is chat's required, a
named tool is a named function, `disable_parallel_tool_use` is parallel_tool_calls false; `stop_sequences` are the
stop strings. From there it is the chat request's path: tools, grammars, speculation, batching, cancellation,
metrics and the guard.

The answer's `content` is a text block and the calls as `tool_use` blocks (`input` an object, ids `toolu_...`);
`stop_reason` end_turn, max_tokens, stop_sequence (with the string) or tool_use; `usage` counts the prompt tokens
decoded (`input_tokens`) apart from those reused from the KV cache (`cache_read_input_tokens`), as Anthropic counts
a cache read; localspec's speculation figures sit beside it (`localspec`). Streamed with Anthropic's events
(message_start, ping, content_block_start / _delta / _stop, message_delta, message_stop); the stream opens at once
and pings while the prompt is prefilled, so a client's read timeout does not end a long first request. Errors are
Anthropic's `{"type": "error", "error": {"type", "message"}}` (`AnthropicErrors`), mid-stream an `error` event."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any, Optional

from localspec.core.engine import Finished, Piece
from localspec.server.tool_calls import ToolCall, parse
from localspec.server.tool_retry import Again
from localspec.server.tool_stream import ToolStream, argument_pieces
from localspec.server.tool_template import template_tool_calls
from localspec.server.config import MAX_STOPS
from localspec.server.openai import APIError, localspec_stats
from localspec.server.schemas import Common

PATH = "/v1/messages"  # the endpoint and count_tokens under it: errors there are in Anthropic's shape
PING_S = 10.0  # a ping after this long without an event: the stream stays open through a long prefill
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


def messages_of(req: MessagesRequest) -> list[dict]:
    """The chat messages of a Messages request (see the module doc). 400 naming the field for what this server
    cannot read."""
    check(req)
    out = []
    system = _texts(req.system, "system", "system")
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


# ------------------------------------------------------------------ the answer
def tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def tool_use(call: ToolCall, whole: bool = True) -> dict:
    return {"type": "tool_use", "id": tool_use_id(call), "name": call.name,
            "input": json.loads(call.arguments) if whole else {}}


def usage(stats) -> dict:
    """Anthropic's usage: input_tokens are the prompt tokens decoded, cache reads the ones reused (their sum is the
    prompt)."""
    cached = min(stats.cached_prompt_tokens or 0, stats.prompt_tokens)
    return {"input_tokens": stats.prompt_tokens - cached, "output_tokens": stats.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def matched_stop(fin: Finished, stops, target) -> str | None:
    """The stop sequence that ended the answer (None: it ended otherwise). The text stops where the string began;
    the tokens' own text goes on with it."""
    if fin.finish_reason != "stop" or not stops or not fin.tokens:
        return None
    full = b"".join(target.piece(int(t)) for t in fin.tokens).decode("utf-8", "replace")
    if not full.startswith(fin.text):
        return None
    rest = full[len(fin.text):]
    return next((s for s in stops if s and rest.startswith(s)), None)


def stop_reason(fin: Finished, calls: list, stops, target) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). Cut by the token limit it is max_tokens even after whole calls (they come
    back; one cut off does not), as chat's finish_reason stays length."""
    if fin.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    seq = matched_stop(fin, stops, target)
    return ("stop_sequence", seq) if seq is not None else ("end_turn", None)


def message(name: str, cid: str, content: list, reason, seq, use: dict) -> dict:
    return {"id": f"msg_{cid}", "type": "message", "role": "assistant", "model": name, "content": content,
            "stop_reason": reason, "stop_sequence": seq, "usage": use}


def whole(name: str, req: MessagesRequest, names: set[str] | None, target):
    """The non-streamed answer; `names`: the tools' names (None: no tools), whose calls become tool_use blocks."""
    def build(cid, now, fin, cfg):
        content, calls = parse(fin.text, names) if names is not None else (fin.text, [])
        blocks = [{"type": "text", "text": content}] if content or not calls else []
        blocks += [tool_use(c) for c in calls]
        reason, seq = stop_reason(fin, calls, req.stop_sequences, target)
        body = message(name, cid, blocks, reason, seq, usage(fin.stats))
        body["localspec"] = localspec_stats(fin.stats, cfg)
        return body
    return build


def event(kind: str, **data) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n".encode()


def error_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
            529: "overloaded_error"}.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_status(status: int) -> int:
    """Anthropic's status for one of ours: a full queue or a server shutting down is 529 (overloaded), a body of
    another type 400."""
    if status == 503:
        return 529
    return 400 if status in (415, 422) else status


def worded(message: str, param) -> str:
    """An error's message naming the field it is about (Anthropic's errors have no `param`)."""
    return message if not isinstance(param, str) or param in message else f"{param}: {message}"


def error_of(err: APIError) -> dict:
    status = anthropic_status(err.status)
    return {"type": "error", "error": {"type": error_type(status), "message": worded(err.message, err.param)}}


def text_delta(out: list, text: str, index: int, text_open: bool) -> tuple[int, bool]:
    """Append `text` to a stream's events as a text delta, opening a text block first where none is open; returns the
    block index and whether a text block is open."""
    if not text_open:
        index, text_open = index + 1, True
        out.append(event("content_block_start", index=index, content_block={"type": "text", "text": ""}))
    out.append(event("content_block_delta", index=index, delta={"type": "text_delta", "text": text}))
    return index, text_open


async def stream(name: str, req: MessagesRequest, names: set[str] | None, target, job, ev, cfg, cid: str, now: int):
    """Anthropic's server-sent events for one generation. `ev` None: the stream opens before the first event (a
    ping every PING_S while the prompt is prefilled or the request waits in the queue). With tools (`names`), text
    that may be a call is held back (tool_stream.ToolStream): a text block opens with the first text; each call is sent
    at the end as a tool_use block with its input in pieces."""
    splitter = ToolStream(names) if names is not None else None
    index, text_open = -1, False
    last = time.monotonic()
    start = message(name, cid, [], None, None, {"input_tokens": job.n_prompt, "output_tokens": 0,
                                                "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0})
    getter = None
    try:
        yield event("message_start", message=start)
        yield event("ping")
        while True:
            if ev is None:
                if getter is None:  # one read at a time: a read left waiting through a ping takes the next event
                    getter = asyncio.ensure_future(job.events.get())
                done, _ = await asyncio.wait({getter}, timeout=PING_S)
                if not done:
                    yield event("ping")
                    last = time.monotonic()
                    continue
                ev, getter = getter.result(), None
            if isinstance(ev, APIError):
                yield event("error", error=error_of(ev)["error"])
                break
            out: list[bytes] = []
            if isinstance(ev, Again):  # generated again: the echo held back is dropped, unsent
                splitter.again()
            if isinstance(ev, Piece):
                piece = ev.text if splitter is None else splitter.feed(ev.text)
                if piece:
                    index, text_open = text_delta(out, piece, index, text_open)
            elif isinstance(ev, Finished):
                calls: list = []
                if splitter is not None:
                    rest, calls = splitter.end()
                    if rest:
                        index, text_open = text_delta(out, rest, index, text_open)
                if not text_open and not calls:  # an empty answer: an empty text block, as when whole
                    index, text_open = index + 1, True
                    out.append(event("content_block_start", index=index, content_block={"type": "text", "text": ""}))
                if text_open:
                    out.append(event("content_block_stop", index=index))
                for call in calls:
                    index += 1
                    out.append(event("content_block_start", index=index, content_block=tool_use(call, whole=False)))
                    out += [event("content_block_delta", index=index, delta={"type": "input_json_delta",
                                                                             "partial_json": piece})
                            for piece in argument_pieces(call.arguments)]
                    out.append(event("content_block_stop", index=index))
                reason, seq = stop_reason(ev, calls, req.stop_sequences, target)
                out.append(event("message_delta", delta={"stop_reason": reason, "stop_sequence": seq},
                                 usage=usage(ev.stats), localspec=localspec_stats(ev.stats, cfg)))
                out.append(event("message_stop"))
                for e in out:
                    yield e
                break
            if not out and time.monotonic() - last >= PING_S:  # text held back (a long call): keep the line alive
                out.append(event("ping"))
            for e in out:
                yield e
            if out:
                last = time.monotonic()
            ev = None
    finally:
        if getter is not None and not getter.done():
            getter.cancel()
        job.cancel.set()  # a no-op once finished; stops the generation when the client went away


# ------------------------------------------------------------------ errors in Anthropic's shape
class AnthropicErrors:
    """ASGI middleware: under /v1/messages, an error response (status 400 and up, an OpenAI-style body from any
    layer: the guard, a route, the queue) is sent as Anthropic's `{"type": "error", "error": {"type", "message"},
    "request_id"}`, with Anthropic's status (anthropic_status)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not (scope["path"] == PATH or scope["path"].startswith(PATH + "/")):
            return await self.app(scope, receive, send)
        start: dict | None = None
        chunks: list[bytes] = []

        async def wrapped(message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length",
                                                                                         b"content-type")]
            rid = next((v.decode("latin-1") for k, v in headers if k.lower() == b"x-request-id"), None)
            status, data = reshape(start["status"], b"".join(chunks))
            if rid is not None:
                data["request_id"] = rid
            body = json.dumps(data).encode()
            headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, wrapped)


def reshape(status: int, raw: bytes) -> tuple[int, dict]:
    """(Anthropic's status, its error body) for an error response of ours."""
    try:
        err = json.loads(raw).get("error") or {}
    except (ValueError, AttributeError):
        err = {}
    message = err.get("message") if isinstance(err, dict) else None
    if not isinstance(message, str):
        message = raw.decode("utf-8", "replace").strip() or f"HTTP {status}"
    param = err.get("param") if isinstance(err, dict) else None
    new = anthropic_status(status)
    return new, {"type": "error", "error": {"type": error_type(new), "message": worded(message, param)}}
