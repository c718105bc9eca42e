"""A request's life on the server, from its fields to its answer: the settings it asks for checked and resolved
into a generation's config (`Generations.gen_config`), its prompt built off the event loop and checked against the
context, its n choices queued on the worker (server/queue.py), and the answer sent whole or streamed (the events:
server/streaming.py), read for tool calls where the request has tools; a client that leaves cancels its
generations.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from localspec import session as S
from localspec.core.engine import Finished, GenConfig, Piece
from localspec.core.generation import check_prompt
from localspec.errors import ContextOverflowError, LocalspecError, UsageError
from localspec.server import openai as O
from localspec.server.config import ALIASES, ServerConfig
from localspec.server.grammar import constraint_for
from localspec.server.metrics import Metrics
from localspec.server.openai import APIError, error_body, setting_error
from localspec.server.queue import ClientGone, Job, Worker, next_event
from localspec.server.schemas import Common, logit_bias_of, logprobs_of, stops
from localspec.server.streaming import chat_events, merged
from localspec.server.tool_calls import answer_calls
from localspec.server.tool_retry import Again, Retry
from localspec.server.tool_stream import ToolStream


def model_id(session) -> str:
    """The served model's name: the pair name, or the target's file name."""
    return session.pair.name if session.pair is not None else session.target_path.name


MAX_N = 8  # choices per request: each is a generation of its own, decoded beside the others under --parallel


def check_ranges(req: Common) -> None:
    """The checks OpenAI applies before anything else (the engine checks the rest)."""
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be between 1 and {MAX_N}, got {req.n}", param="n")
    t = req.temperature
    if t is not None and t > 2:
        raise APIError(400, f"temperature must be between 0 and 2, got {t}", param="temperature")
    for key in ("presence_penalty", "frequency_penalty"):
        x = getattr(req, key)
        if x is not None and not -2 <= x <= 2:
            raise APIError(400, f"{key} must be between -2 and 2, got {x}", param=key)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")


async def _or_cancel(jobs, awaitable):
    """What `awaitable` gives for the jobs' events; a client that left: a 499 response; any other error cancels every
    job (none goes on decoding for nobody) and is raised."""
    try:
        return await awaitable
    except ClientGone:
        return JSONResponse(error_body("client disconnected"), status_code=499)
    except BaseException:
        for job in jobs:
            job.cancel.set()
        raise


class Generations:
    """What the routes share: the session's settings resolved once, the served name, the worker."""

    def __init__(self, session, cfg: ServerConfig, log: Callable[[str], None]) -> None:
        self.engine = session.engine
        self.base = session.values()  # the request's own values change only its generation
        self.cfg = cfg
        self.name = model_id(session)
        self.accepted_names = {self.name, session.target_path.name, session.target_path.stem, *ALIASES}
        self.worker = Worker(session, cfg.queue_size, log, parallel=cfg.parallel or 1, kv_layout=cfg.kv_layout,
                             speculative=self.base.get("method", "auto") != "none")
        self.metrics = None if cfg.no_metrics else Metrics(self.name, self.worker)
        self.worker.metrics = self.metrics

    def client_error(self) -> None:
        """Count a request refused for what it asked (metrics.OUTCOMES): not a failed generation."""
        self.worker.counts["client_error"] += 1
        if self.metrics is not None:
            self.metrics.requests.labels(outcome="client_error").inc()

    async def prompt(self, build, cfg: GenConfig) -> list[int]:
        """The request's prompt tokens, built off the event loop (template and tokenizer only read the model, as
        llama-server tokenizes beside its decoding), checked against the context before the request queues: a
        prompt the context cannot hold is a 400 counted as client_error, not a failed generation."""
        try:
            tokens = await asyncio.to_thread(build, self.engine)
            return check_prompt(tokens, self.engine.target.n_ctx, cfg.max_tokens)
        except ContextOverflowError as exc:
            self.client_error()
            raise setting_error(exc, code="context_length_exceeded") from None
        except UsageError as exc:
            raise setting_error(exc) from None
        except LocalspecError as exc:
            raise setting_error(exc, 500) from None

    def check_model(self, model: str | None) -> None:
        """Any name is served by the one loaded pair (as llama-server does), unless strict_model: then 404."""
        if model is not None and self.cfg.strict_model and model not in self.accepted_names:
            raise APIError(404, f"model {model!r} is not served here; this server serves {self.name!r}",
                           param="model", code="model_not_found")

    def gen_config(self, req: Common, constraint=None) -> GenConfig:
        """`constraint`: a grammar the answer must follow (a forced tool call) instead of response_format's."""
        self.check_model(req.model)
        check_ranges(req)
        changes: dict[str, Any] = {}
        mt = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if mt is not None:
            changes["max_tokens"] = mt
        for key in ("temperature", "top_p", "seed", "top_k"):  # top_k: on /v1/messages only
            if getattr(req, key, None) is not None:
                changes[key] = getattr(req, key)
        if req.localspec is not None:
            for key, setting in (("method", "method"), ("k", "draft_tokens"), ("exactness", "exactness")):
                if getattr(req.localspec, key) is not None:
                    changes[setting] = getattr(req.localspec, key)
        v = {**self.base, **changes}
        try:
            S.validate(v)
            cfg = S.gen_config(v, stops(req.stop))
            self.engine.resolve_method(cfg)  # e.g. method draft without a draft model: 400 before the request queues
        except UsageError as exc:
            raise setting_error(exc) from None
        cfg.constraint = constraint or constraint_for(req.response_format, self.engine.target)  # 400: a bad schema
        cfg.logprobs = logprobs_of(req)
        cfg.logit_bias = logit_bias_of(req.logit_bias, self.engine.target.n_vocab)
        if "draft_tokens" in changes and cfg.k > self.cfg.max_k:  # each new k may start an exactness probe
            raise APIError(400, f"localspec.k must be <= {self.cfg.max_k} on this server, got {cfg.k}",
                           param="localspec.k")
        return cfg

    def choice_config(self, req: Common, i: int, constraint_again=None) -> GenConfig:
        """Choice i of a request with n > 1: a generation of its own, with its own grammar (constraint_again()
        builds the request's tool grammar again; response_format's is built by gen_config) and its own sampling
        stream (seed + i where a seed is given, else a fresh one)."""
        cfg = self.gen_config(req, constraint_again() if constraint_again is not None else None)
        seed = cfg.sampling.seed
        cfg.sampling = dataclasses.replace(cfg.sampling, seed=None if seed is None else seed + i)
        return cfg

    async def run(self, request: Request, req: Common, build, chunk, whole, tools: set[str] | None = None,
                  stream=None, logprobs=None, constraint=None, constraint_again=None, early: bool = False,
                  again=None):
        """`tools`: the names of the request's tools (None: no tools); the answer is then read for tool calls.
        `stream(job, first event, cfg, cid, now)`: the streamed body's events, instead of chat/completions' (one
        answer: the endpoints that have their own, /v1/responses and /v1/messages, take no n). `early`: the stream
        opens as soon as the request is queued, its first event None (the stream waits for it, and answers an error
        in its own events).
        `logprobs`: how the answer's logprobs are written (O.chat_logprobs, O.completion_logprobs), if asked for.
        `constraint`: the grammar of a forced tool call (server/tool_grammar.py).
        `again`: (the names the answer is read against (tool_calls.reading), turn()): an answer that only echoes calls
        answered in this turn is generated once more as under tool_choice none, turn() giving that request's prompt
        builder and grammar (tool_retry.Retry), whole or streamed, each of n choices on its own."""
        cfg = self.gen_config(req, constraint)
        tokens = await self.prompt(build, cfg)
        n = req.n or 1
        cfgs = [cfg] + [self.choice_config(req, i, constraint_again) for i in range(1, n)]
        lps = [O.Logprobs(self.engine.target, logprobs) if logprobs is not None and cfg.logprobs is not None else None
               for _ in range(n)]
        jobs = [Job(lambda eng: tokens, c, asyncio.get_running_loop(), asyncio.Queue(), n_prompt=len(tokens))
                for c in cfgs]
        for job in jobs:
            self.worker.submit(job)
        if again is not None:  # the jobs' events, read through a second generation where one is needed
            jobs = [Retry(job, again[0], lambda i=i: self._again(req, i, again[1])) for i, job in enumerate(jobs)]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        cid = uuid.uuid4().hex[:24]
        now = int(time.time())
        if early and req.stream and n == 1:
            # cancelled also when the client leaves before the body's first event (the generator never ran)
            return StreamingResponse(stream(jobs[0], None, cfg, cid, now), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(jobs[0].cancel.set))
        async def first_events():
            return [await next_event(request, job) for job in jobs]

        firsts = await _or_cancel(jobs, first_events())
        if isinstance(firsts, JSONResponse):
            return firsts
        for first in firsts:
            if isinstance(first, APIError):
                for job in jobs:
                    job.cancel.set()
                return first.response()
        if not req.stream:
            fins = await _or_cancel(jobs, asyncio.gather(*[self._whole(request, job, first, lp)
                                                          for job, first, lp in zip(jobs, firsts, lps)]))
            if isinstance(fins, JSONResponse):
                return fins
            for fin in fins:
                if isinstance(fin, APIError):
                    return fin.response()
            bodies = []
            for i, (fin, c, lp) in enumerate(zip(fins, cfgs, lps)):
                body = whole(cid, now, fin, c)
                if n > 1:
                    body["choices"][0]["index"] = i
                if lp is not None:
                    body["choices"][0]["logprobs"] = lp.take()
                if tools is not None:
                    answer_calls(body, fin, tools)
                bodies.append(body)
            body = bodies[0]
            if n > 1:  # one body: every choice, and the usage of all of them (the prompt counted once)
                body["choices"] = [b["choices"][0] for b in bodies]
                done = sum(b["usage"]["completion_tokens"] for b in bodies)
                body["usage"] = {**body["usage"], "completion_tokens": done,
                                 "total_tokens": body["usage"]["prompt_tokens"] + done}
                body["localspec"] = {**body["localspec"], "choices": [b["localspec"] for b in bodies]}
            return JSONResponse(body)
        if n == 1:
            splitter = ToolStream(tools) if tools is not None else None
            body = (stream(jobs[0], firsts[0], cfg, cid, now) if stream is not None
                    else chat_events(self.name, jobs[0], firsts[0], cfg, cid, now, chunk, include_usage, splitter,
                                      lps[0]))
        else:
            body = merged([chat_events(self.name, job, first, c, cid, now, chunk, include_usage,
                                       ToolStream(tools) if tools is not None else None, lp)
                           for job, first, c, lp in zip(jobs, firsts, cfgs, lps)], include_usage)
        return StreamingResponse(body,
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _whole(self, request: Request, job: Job, ev, lp):
        """A job's events up to its Finished (or its error), the logprobs gathered on the way."""
        while not isinstance(ev, Finished):
            if isinstance(ev, APIError):
                return ev
            if lp is not None and isinstance(ev, Piece):
                lp.add(ev)
            if lp is not None and isinstance(ev, Again):  # the echo's tokens are no part of the answer
                lp.take()
            ev = await next_event(request, job)
        return ev

    async def _again(self, req: Common, i: int, turn):
        """Choice i generated once more as under tool_choice none (turn(): its prompt builder and grammar), its job
        submitted (tool_retry.Retry); None when it cannot be (a full queue, say): the first answer stands."""
        build, constraint = turn()
        try:
            cfg = self.choice_config(req, i, lambda: constraint)
            tokens = await self.prompt(build, cfg)
            job = Job(lambda eng: tokens, cfg, asyncio.get_running_loop(), asyncio.Queue(), n_prompt=len(tokens))
            self.worker.submit(job)
        except APIError:
            return None
        return job
