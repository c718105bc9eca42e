"""`POST /v1/responses`: OpenAI's Responses API, text in and text out: `input` (a string or a list of messages with
text parts), `instructions` (a system message), `max_output_tokens`, and the streaming events clients read
(`response.created`, `response.in_progress`, `response.output_item.added`, `response.content_part.added`,
`response.output_text.delta`, `...done`, `response.completed`). Not kept server-side (`previous_response_id` is a
400); tools are not read here (use /v1/chat/completions for them)."""

from __future__ import annotations

import json
from typing import Any, Optional

from localspec.core.engine import Finished, GenConfig, Piece
from localspec.server.openai import APIError, localspec_stats
from localspec.server.schemas import Common

TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(Common):
    input: Any = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    previous_response_id: Optional[str] = None
    tools: Any = None
    store: Optional[bool] = None  # accepted; nothing is stored


def messages_of(req: ResponsesRequest) -> list[dict]:
    """The chat messages of a Responses request (instructions first, as the system message). Its own fields are
    checked here, so a 400 names the field the client sent (max_output_tokens, not the max_tokens it becomes)."""
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise APIError(400, f"max_output_tokens must be >= 1, got {req.max_output_tokens}", param="max_output_tokens")
    if req.previous_response_id is not None:
        raise APIError(400, "previous_response_id is not supported: this server keeps no responses; send the "
                            "conversation in input", param="previous_response_id")
    if req.tools:
        raise APIError(400, "tools are not supported on /v1/responses here; use /v1/chat/completions",
                       param="tools")
    out = [{"role": "system", "content": req.instructions}] if req.instructions else []
    x = req.input
    if isinstance(x, str):
        if not x:
            raise APIError(400, "input is empty", param="input")
        return out + [{"role": "user", "content": x}]
    if not isinstance(x, list) or not x:
        raise APIError(400, "input must be a string or a non-empty list of messages", param="input")
    for i, item in enumerate(x):
        where = f"input[{i}]"
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise APIError(400, f"{where}: only message items are supported, got {kind!r}", param="input")
        role = {"developer": "system"}.get(item.get("role"), item.get("role"))
        if role not in ("system", "user", "assistant"):
            raise APIError(400, f"{where}.role {item.get('role')!r} is not supported; use system, developer, "
                                "user or assistant", param="input")
        c = item.get("content")
        if isinstance(c, list):
            texts = []
            for j, part in enumerate(c):
                if not (isinstance(part, dict) and part.get("type") in TEXT_PARTS and isinstance(part.get("text"), str)):
                    raise APIError(400, f"{where}.content[{j}]: only text parts are supported", param="input")
                texts.append(part["text"])
            c = "\n".join(texts)
        if not isinstance(c, str):
            raise APIError(400, f"{where}.content must be a string or a list of text parts", param="input")
        out.append({"role": role, "content": c})
    return out


def usage(stats) -> dict:
    return {"input_tokens": stats.prompt_tokens, "input_tokens_details": {"cached_tokens": stats.cached_prompt_tokens},
            "output_tokens": stats.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": stats.prompt_tokens + stats.completion_tokens}


def message_item(cid: str, text: str, status: str) -> dict:
    return {"type": "message", "id": f"msg_{cid}", "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": []}]}


def response_object(name: str, cid: str, now: int, req: ResponsesRequest, status: str, output: list,
                    fin: Finished | None = None, cfg: GenConfig | None = None) -> dict:
    d = {"id": f"resp_{cid}", "object": "response", "created_at": now, "status": status, "model": name,
         "output": output, "instructions": req.instructions, "error": None, "incomplete_details": None,
         "max_output_tokens": req.max_output_tokens, "metadata": {}, "parallel_tool_calls": False,
         "temperature": req.temperature, "top_p": req.top_p, "tool_choice": "none", "tools": [],
         "text": {"format": {"type": "text"}}, "usage": None}
    if fin is not None:
        d["usage"] = usage(fin.stats)
        d["localspec"] = localspec_stats(fin.stats, cfg)
        if fin.finish_reason == "length":
            d["status"] = "incomplete"
            d["incomplete_details"] = {"reason": "max_output_tokens"}
        elif fin.finish_reason == "cancelled":
            d["status"] = "cancelled"
    return d


def whole(name: str, req: ResponsesRequest):
    def build(cid, now, fin, cfg):
        status = "completed" if fin.finish_reason == "stop" else "incomplete"
        return response_object(name, cid, now, req, status, [message_item(cid, fin.text, status)], fin, cfg)
    return build


def event(kind: str, seq: int, **data) -> bytes:
    body = {"type": kind, "sequence_number": seq, **data}
    return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


async def stream(name: str, req: ResponsesRequest, job, ev, cfg: GenConfig, cid: str, now: int):
    """The Responses API's server-sent events for one generation."""
    seq = 0

    def nxt(kind: str, **data) -> bytes:
        nonlocal seq
        seq += 1
        return event(kind, seq - 1, **data)

    item_id = f"msg_{cid}"
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    text = ""
    try:
        yield nxt("response.created", response=response_object(name, cid, now, req, "in_progress", []))
        yield nxt("response.in_progress", response=response_object(name, cid, now, req, "in_progress", []))
        yield nxt("response.output_item.added", output_index=0, item=message_item(cid, "", "in_progress"))
        yield nxt("response.content_part.added", **where,
                  part={"type": "output_text", "text": "", "annotations": []})
        while True:
            if isinstance(ev, APIError):
                yield nxt("error", code=ev.code, message=ev.message, param=ev.param)
                break
            if isinstance(ev, Piece):
                if ev.text:
                    text += ev.text
                    yield nxt("response.output_text.delta", **where, delta=ev.text, logprobs=[])
            elif isinstance(ev, Finished):
                status = "completed" if ev.finish_reason == "stop" else "incomplete"
                item = message_item(cid, ev.text, status)
                yield nxt("response.output_text.done", **where, text=ev.text, logprobs=[])
                yield nxt("response.content_part.done", **where, part=item["content"][0])
                yield nxt("response.output_item.done", output_index=0, item=item)
                resp = response_object(name, cid, now, req, status, [item], ev, cfg)
                kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
                    resp["status"], "response.failed")
                yield nxt(kind, response=resp)
                break
            ev = await job.events.get()
    finally:
        job.cancel.set()  # a no-op once finished; stops the generation when the client went away

