"""The answer to a Messages request (server/anthropic_request.py), whole (`whole`) or streamed (`stream`).

The answer's `content` is a text block and the calls as `tool_use` blocks (`input` an object, ids `toolu_...`);
`stop_reason` end_turn, max_tokens, stop_sequence (with the string) or tool_use; `usage` counts the prompt tokens
decoded (`input_tokens`) apart from those reused from the KV cache (`cache_read_input_tokens`), as Anthropic counts
a cache read; localspec's speculation figures sit beside it (`localspec`). Streamed with Anthropic's events
(message_start, ping, content_block_start / _delta / _stop, message_delta, message_stop); the stream opens at once
and pings while the prompt is prefilled, so a client's read timeout does not end a long first request. An error
mid-stream is an `error` event."""

from __future__ import annotations

import asyncio
import json
import time

from localspec.core.engine import Finished, Piece
from localspec.server.anthropic_errors import error_of
from localspec.server.anthropic_request import MessagesRequest
from localspec.server.openai import APIError, localspec_stats
from localspec.server.tool_calls import ToolCall, parse
from localspec.server.tool_retry import Again
from localspec.server.tool_stream import ToolStream, argument_pieces

PING_S = 10.0  # a ping after this long without an event: the stream stays open through a long prefill


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
