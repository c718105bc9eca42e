"""A chat or completions answer streamed as OpenAI's server-sent events: one choice's chunks (`chat_events`: the
text as it comes, or held back while it may be a tool call and then sent as call deltas; the logprobs with the
chunk of their tokens; the finish chunk with localspec's stats, and the usage chunk when asked for), and the streams
of n choices merged into one (`merged`).
"""

from __future__ import annotations

import asyncio
import json

from localspec.core.engine import Finished, GenConfig, Piece
from localspec.server import openai as O
from localspec.server.openai import APIError, localspec_stats, sse, usage
from localspec.server.queue import Job
from localspec.server.tool_calls import finish_reason
from localspec.server.tool_retry import Again
from localspec.server.tool_stream import ToolStream, call_deltas


async def chat_events(name: str, job: Job, ev, cfg: GenConfig, cid: str, now: int, chunk, include_usage: bool,
                      splitter: ToolStream | None = None, lp: O.Logprobs | None = None):
    """One choice's chunks (`chunk` writes them: chat's or completions'), from its first event `ev` to [DONE].
    `splitter`: the request's tools, whose calls are held back and sent as call deltas; `lp`: the logprobs asked
    for."""
    def with_logprobs(c: dict) -> dict:  # a chunk carries the logprobs of the tokens since the last one
        if lp is not None and lp.pending:
            c["choices"][0]["logprobs"] = lp.take()
        return c

    # with tools the opening chunk (the assistant role) waits for the answer's first content or call: a call
    # that opens the answer carries the role itself, with content null, as OpenAI streams it
    opened = splitter is None
    try:
        if opened:
            yield sse(chunk(cid, now, None, None))
        while True:
            if isinstance(ev, APIError):  # a failed generation, or the server shutting down
                yield sse(ev.body())
                break
            if isinstance(ev, Again):  # generated again: the echo held back is dropped, unsent
                splitter.again()
                if lp is not None:
                    lp.take()
            if isinstance(ev, Piece):
                if lp is not None:
                    lp.add(ev)
                text = ev.text if splitter is None else splitter.feed(ev.text)
                if text:
                    if not opened:
                        yield sse(chunk(cid, now, None, None))
                        opened = True
                    yield sse(with_logprobs(chunk(cid, now, text, None)))
            elif isinstance(ev, Finished):
                finish = ev.finish_reason
                if splitter is not None:  # the held-back text: content, or the tool calls (arguments in deltas)
                    rest, calls = splitter.end()
                    if rest:
                        if not opened:
                            yield sse(chunk(cid, now, None, None))
                            opened = True
                        yield sse(with_logprobs(chunk(cid, now, rest, None)))
                    for i, call in enumerate(calls):
                        for delta in call_deltas(call, i, role=not opened):
                            yield sse(O.chat_delta(name, cid, now, delta))
                        opened = True
                    finish = finish_reason(finish, calls)
                    if not opened:
                        yield sse(chunk(cid, now, None, None))
                last = with_logprobs(chunk(cid, now, None, finish))  # (tokens whose text was held back)
                last["localspec"] = localspec_stats(ev.stats, cfg)
                yield sse(last)
                if include_usage:
                    u = chunk(cid, now, None, None)
                    u["choices"] = []
                    u["usage"] = usage(ev.stats)
                    u["localspec"] = last["localspec"]
                    yield sse(u)
                break
            ev = await job.events.get()
        yield O.DONE
    finally:
        job.cancel.set()  # a no-op once finished; stops the generation when the client went away


async def merged(streams: list, include_usage: bool):
    """The SSE events of n choices' streams as one stream, as OpenAI sends n > 1: each chunk names its choice
    by `index`; one [DONE] at the end, after one usage chunk for all choices when asked for."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, gen):
        try:
            async for ev in gen:
                await q.put((i, ev))
        finally:
            await q.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(streams)]
    left, usages, last = len(streams), [], None
    try:
        while left:
            i, ev = await q.get()
            if ev is None:
                left -= 1
                continue
            if ev == O.DONE:
                continue
            obj = json.loads(ev[len(b"data: "):])
            if "usage" in obj and not obj.get("choices"):  # each choice's usage: one chunk for all, at the end
                usages.append(obj["usage"])
                last = obj
                continue
            for c in obj.get("choices") or ():
                c["index"] = i
            yield sse(obj)
        if last is not None:
            done = sum(u["completion_tokens"] for u in usages)
            last["usage"] = {**usages[0], "completion_tokens": done, "total_tokens": usages[0]["prompt_tokens"] + done}
            last.pop("localspec", None)
            yield sse(last)
        yield O.DONE
    finally:
        for t in tasks:
            t.cancel()
