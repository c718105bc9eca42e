"""`POST /v1/responses`: OpenAI's Responses API as the Agents SDK and other clients send it: `input` (a string, or a
list of message items with text parts, `function_call` items and `function_call_output` items), `instructions`
(a system message), `max_output_tokens`, function `tools` with `tool_choice` and `parallel_tool_calls`, and
`text.format` (json_object / json_schema: the answer is decoded under the schema, as chat's response_format). The
answer's calls come back as `function_call` output items. Streamed with the events clients read
(`response.created`, `response.in_progress`, `response.output_item.added`, `response.content_part.added`,
`response.output_text.delta`, `response.function_call_arguments.delta`, `...done`, `response.completed`). Not kept
server-side (`previous_response_id` is a 400). One answer per response, as upstream: `n` other than 1 is a 400."""

from __future__ import annotations

import json
from typing import Any, Optional

from localspec.core.engine import Finished, GenConfig, Piece
from localspec.server.tool_calls import ToolCall, parse
from localspec.server.tool_retry import Again
from localspec.server.tool_stream import ToolStream, argument_pieces
from localspec.server.tool_template import template_tool_calls
from localspec.server.openai import APIError, localspec_stats
from localspec.server.schemas import Common

TEXT_PARTS = ("input_text", "output_text", "text")
SKIPPED = ("reasoning",)  # items a client sends back that say nothing to this model


class ResponsesRequest(Common):
    input: Any = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    previous_response_id: Optional[str] = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Optional[bool] = None
    text: Any = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    store: Optional[bool] = None  # accepted; nothing is stored


def chat_tools(req: ResponsesRequest) -> tuple[list[dict] | None, Any]:
    """The request's tools and tool_choice in chat's form ({"type": "function", "function": {...}}). Function tools
    only: a hosted tool (web_search, file_search ...) is a 400 naming tools[i]."""
    tools = req.tools
    if tools is not None and not isinstance(tools, list):
        raise APIError(400, "tools must be a list of function tools", param="tools")
    out = None
    if tools:
        out = []
        for i, t in enumerate(tools):
            kind = t.get("type", "function") if isinstance(t, dict) else None
            if kind != "function":
                raise APIError(400, f"tools[{i}]: only function tools are supported here, got {kind!r}",
                               param=f"tools[{i}]")
            f = t["function"] if isinstance(t.get("function"), dict) else \
                {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
            out.append({"type": "function", "function": f})
    choice = req.tool_choice
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function" and isinstance(choice.get("name"), str):
            choice = {"type": "function", "function": {"name": choice["name"]}}
        elif not (kind == "function" and isinstance(choice.get("function"), dict)):
            raise APIError(400, f"tool_choice of type {kind!r} is not supported here; use \"none\", \"auto\", "
                                "\"required\" or {\"type\": \"function\", \"name\": ...}", param="tool_choice")
    return out, choice


def output_format(req: ResponsesRequest) -> tuple[dict | None, str | None]:
    """(the JSON Schema `text.format` asks the answer to follow, its grammar); (None, None): free text. 400 naming
    text.format for a bad or unsupported one."""
    from localspec.server.grammar import format_schema, usable_schema
    from localspec.server.json_schema import closed

    if req.text is None:
        return None, None
    if not isinstance(req.text, dict):
        raise APIError(400, "text must be an object: {\"format\": {...}}", param="text")
    fmt = req.text.get("format")
    if fmt is None:
        return None, None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, "text.format must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}",
                       param="text.format")
    if fmt["type"] == "json_schema" and not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "text.format.schema must be a JSON Schema object", param="text.format")
    schema = format_schema({"type": fmt["type"], "json_schema": {"schema": fmt.get("schema")}}, "text.format")
    if schema is None:
        return None, None
    return usable_schema(closed(schema), "text.format", "text.format")


def _text(c, where: str) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        texts = []
        for j, part in enumerate(c):
            if not (isinstance(part, dict) and part.get("type") in TEXT_PARTS and isinstance(part.get("text"), str)):
                raise APIError(400, f"{where}[{j}]: only text parts are supported", param="input")
            texts.append(part["text"])
        return "\n".join(texts)
    raise APIError(400, f"{where} must be a string or a list of text parts", param="input")


def messages_of(req: ResponsesRequest) -> list[dict]:
    """The chat messages of a Responses request (instructions first, as the system message; a `function_call` item
    joins the assistant turn before it, a `function_call_output` is a tool turn). Its own fields are checked here,
    so a 400 names the field the client sent (max_output_tokens, not the max_tokens it becomes)."""
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise APIError(400, f"max_output_tokens must be >= 1, got {req.max_output_tokens}", param="max_output_tokens")
    # a response holds one answer (the Responses API has no n): several answers are several requests, or chat
    # completions' n; refused here, before anything queues, rather than answered in a shape no client reads
    if req.n is not None and req.n != 1:
        raise APIError(400, f"n is not a Responses API parameter (a response holds one answer), got {req.n}; send "
                            "one request per answer, or use /v1/chat/completions with n", param="n")
    if req.previous_response_id is not None:
        raise APIError(400, "previous_response_id is not supported: this server keeps no responses; send the "
                            "conversation in input", param="previous_response_id")
    out = [{"role": "system", "content": req.instructions}] if req.instructions else []
    x = req.input
    if isinstance(x, str):
        if not x:
            raise APIError(400, "input is empty", param="input")
        return out + [{"role": "user", "content": x}]
    if not isinstance(x, list) or not x:
        raise APIError(400, "input must be a string or a non-empty list of items", param="input")
    names: dict[str, str] = {}  # call_id -> the function's name (templates print it with the result)
    for i, item in enumerate(x):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
        if kind in SKIPPED:
            continue
        if kind == "function_call":
            if not (isinstance(item.get("name"), str) and isinstance(item.get("call_id"), str)):
                raise APIError(400, f"{where}: a function_call needs name and call_id", param="input")
            args = item.get("arguments", "")
            call = template_tool_calls([{"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}], where)[0]
            names[item["call_id"]] = item["name"]
            if out and out[-1]["role"] == "assistant" and out[-1].get("from_input"):
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call], "from_input": True})
            continue
        if kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}: a function_call_output needs call_id", param="input")
            result = item.get("output", "")
            text = _text(result, f"{where}.output") if isinstance(result, (str, list)) else json.dumps(result)
            msg = {"role": "tool", "tool_call_id": item["call_id"], "content": text}
            if item["call_id"] in names:
                msg["name"] = names[item["call_id"]]
            out.append(msg)
            continue
        if kind != "message":
            raise APIError(400, f"{where}: items of type {kind!r} are not supported; send message, function_call "
                                "and function_call_output items", param="input")
        role = {"developer": "system"}.get(item.get("role"), item.get("role"))
        if role not in ("system", "user", "assistant"):
            raise APIError(400, f"{where}.role {item.get('role')!r} is not supported; use system, developer, "
                                "user or assistant", param="input")
        out.append({"role": role, "content": _text(item.get("content"), f"{where}.content"),
                    **({"from_input": True} if role == "assistant" else {})})
    return [{k: v for k, v in m.items() if k != "from_input"} for m in out]


def usage(stats) -> dict:
    return {"input_tokens": stats.prompt_tokens, "input_tokens_details": {"cached_tokens": stats.cached_prompt_tokens},
            "output_tokens": stats.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": stats.prompt_tokens + stats.completion_tokens}


def message_item(cid: str, text: str, status: str) -> dict:
    return {"type": "message", "id": f"msg_{cid}", "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(call: ToolCall, status: str = "completed") -> dict:
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
            "name": call.name, "arguments": "" if status == "in_progress" else call.arguments, "status": status}


def _status(fin: Finished) -> str:
    return "completed" if fin.finish_reason == "stop" else "incomplete"


def response_object(name: str, cid: str, now: int, req: ResponsesRequest, status: str, output: list,
                    fin: Finished | None = None, cfg: GenConfig | None = None) -> dict:
    fmt = req.text.get("format") if isinstance(req.text, dict) and isinstance(req.text.get("format"), dict) \
        else {"type": "text"}
    d = {"id": f"resp_{cid}", "object": "response", "created_at": now, "status": status, "model": name,
         "output": output, "instructions": req.instructions, "error": None, "incomplete_details": None,
         "max_output_tokens": req.max_output_tokens, "metadata": {},
         "parallel_tool_calls": req.parallel_tool_calls is not False,
         "temperature": req.temperature, "top_p": req.top_p,
         "tool_choice": req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none"),
         "tools": req.tools or [], "text": {"format": fmt}, "usage": None}
    if fin is not None:
        d["usage"] = usage(fin.stats)
        d["localspec"] = localspec_stats(fin.stats, cfg)
        if fin.finish_reason == "length":
            d["status"] = "incomplete"
            d["incomplete_details"] = {"reason": "max_output_tokens"}
        elif fin.finish_reason == "cancelled":
            d["status"] = "cancelled"
    return d


def whole(name: str, req: ResponsesRequest, names: set[str] | None = None):
    """The non-streamed response; `names`: the tools' names (None: no tools), whose calls become function_call
    items."""
    def build(cid, now, fin, cfg):
        status = _status(fin)
        content, calls = parse(fin.text, names) if names is not None else (fin.text, [])
        output = [message_item(cid, content, status)] if content or not calls else []
        output += [call_item(c) for c in calls]
        return response_object(name, cid, now, req, status, output, fin, cfg)
    return build


def event(kind: str, seq: int, **data) -> bytes:
    body = {"type": kind, "sequence_number": seq, **data}
    return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


async def stream(name: str, req: ResponsesRequest, names: set[str] | None, job, ev, cfg: GenConfig, cid: str,
                 now: int):
    """The Responses API's server-sent events for one generation. With tools (`names`), text that may be a call is
    held back (tool_stream.ToolStream): the message item opens with the first text, and each call is sent at the end as
    a function_call item with its arguments in pieces."""
    seq = 0

    def nxt(kind: str, **data) -> bytes:
        nonlocal seq
        seq += 1
        return event(kind, seq - 1, **data)

    splitter = ToolStream(names) if names is not None else None
    where = {"item_id": f"msg_{cid}", "output_index": 0, "content_index": 0}
    text, opened = "", False

    def open_message():
        yield nxt("response.output_item.added", output_index=0, item=message_item(cid, "", "in_progress"))
        yield nxt("response.content_part.added", **where, part={"type": "output_text", "text": "", "annotations": []})

    try:
        yield nxt("response.created", response=response_object(name, cid, now, req, "in_progress", []))
        yield nxt("response.in_progress", response=response_object(name, cid, now, req, "in_progress", []))
        if splitter is None:
            opened = True
            for e in open_message():
                yield e
        while True:
            if isinstance(ev, APIError):
                yield nxt("error", code=ev.code, message=ev.message, param=ev.param)
                break
            if isinstance(ev, Again):  # generated again: the echo held back is dropped, unsent
                splitter.again()
            if isinstance(ev, Piece):
                piece = ev.text if splitter is None else splitter.feed(ev.text)
                if piece:
                    if not opened:
                        opened = True
                        for e in open_message():
                            yield e
                    text += piece
                    yield nxt("response.output_text.delta", **where, delta=piece, logprobs=[])
            elif isinstance(ev, Finished):
                status = _status(ev)
                calls: list = []
                if splitter is not None:
                    rest, calls = splitter.end()
                    if rest:
                        if not opened:
                            opened = True
                            for e in open_message():
                                yield e
                        text += rest
                        yield nxt("response.output_text.delta", **where, delta=rest, logprobs=[])
                    if not calls and not opened:  # an empty answer: an empty message, as without tools
                        opened = True
                        for e in open_message():
                            yield e
                output = []
                if opened:
                    item = message_item(cid, text, status)
                    yield nxt("response.output_text.done", **where, text=text, logprobs=[])
                    yield nxt("response.content_part.done", **where, part=item["content"][0])
                    yield nxt("response.output_item.done", output_index=0, item=item)
                    output.append(item)
                for call in calls:
                    i = len(output)
                    item = call_item(call)
                    yield nxt("response.output_item.added", output_index=i, item=call_item(call, "in_progress"))
                    for piece in argument_pieces(call.arguments):
                        yield nxt("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                                  delta=piece)
                    yield nxt("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                              name=call.name, arguments=call.arguments)
                    yield nxt("response.output_item.done", output_index=i, item=item)
                    output.append(item)
                resp = response_object(name, cid, now, req, status, output, ev, cfg)
                kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
                    resp["status"], "response.failed")
                yield nxt(kind, response=resp)
                break
            ev = await job.events.get()
    finally:
        job.cancel.set()  # a no-op once finished; stops the generation when the client went away
