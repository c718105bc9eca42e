"""`localspec serve`: an OpenAI-compatible HTTP API over one loaded pair, with each response's speculation stats.

It sits on the session layer (settings, model resolution, loading, the machine-wide generation slot) and the engine.
Generations run on a worker thread (server/queue.py), side by side in batch slots with --parallel N. A request that
extends an earlier conversation reuses the target's cached prefix. Who may call it: server/guard.py.

Endpoints: POST /v1/chat/completions, POST /v1/completions (streamed as server-sent events or not), GET /v1/models,
POST /v1/responses (server/responses.py), POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages
API: server/anthropic.py), GET /v1/models/{id}, GET /health, GET /metrics (Prometheus; server/metrics.py). Any model
name is served by the loaded pair (ServerConfig.strict_model: 404). Errors are OpenAI-style objects {"error":
{"message", "type", "param", "code"}} (Anthropic's shape under /v1/messages), never a traceback, and name the
request's JSON fields. Starting and stopping the server: server/main.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from localspec import session as S
from localspec.core.engine import Finished, GenConfig, Piece
from localspec.core.generation import check_prompt
from localspec.errors import ContextOverflowError, LocalspecError, UsageError
from localspec.server import anthropic as A
from localspec.server import openai as O
from localspec.server import responses as R
from localspec.server import tool_grammar as TG
from localspec.server.tool_calls import answer_calls, finish_reason, reading
from localspec.server.tool_retry import Again, Retry
from localspec.server.tool_stream import ToolStream, call_deltas
from localspec.server.tool_template import check_tools, for_template
from localspec.server.config import ALIASES, ServerConfig
from localspec.server.guard import LOCAL_ORIGIN, Gate, Guard, HostCheck, is_local_keyword
from localspec.server.openai import APIError, error_body, invalid, localspec_stats, setting_error, sse, usage  # noqa: F401
from localspec.server.grammar import Grammar, Lazy, constraint_for, schema_of
from localspec.server.metrics import Metrics
from localspec.server.queue import ClientGone, Job, Worker, next_event
from localspec.server.schemas import ChatRequest, Common, CompletionRequest, chat_messages, completion_prompt, \
    logit_bias_of, logprobs_of, parse_body, stops
from localspec.store.suffixcache import scope_of


def model_id(session) -> str:
    """The served model's name: the pair name, or the target's file name."""
    return session.pair.name if session.pair is not None else session.target_path.name


def chat_tokens(eng, msgs: list[dict], tools: list[dict] | None) -> list[int]:
    """The prompt of a chat request: the engine's chat prompt, with `tools` given to the template."""
    return eng.chat_prompt(msgs, tools)


def template_text(eng) -> str | None:
    """The chat template's source (the one given to the engine, else the target's): tool_grammar.call_format reads
    it."""
    return getattr(eng, "_template_source", None) or eng.target.chat_template()


def template_of(eng):
    """The parsed chat template (None: there is none, or it does not parse: building the prompt says so)."""
    try:
        return eng.chat_template()
    except LocalspecError:
        return None


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


def _config(config: ServerConfig | None, **overrides) -> ServerConfig:
    given = {k: v for k, v in overrides.items() if v is not None}
    return (config or ServerConfig()).replace(**given) if given else (config or ServerConfig())


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
        try:
            firsts = [await next_event(request, job) for job in jobs]
        except ClientGone:
            return JSONResponse(error_body("client disconnected"), status_code=499)
        except BaseException:
            for job in jobs:
                job.cancel.set()
            raise
        for first in firsts:
            if isinstance(first, APIError):
                for job in jobs:
                    job.cancel.set()
                return first.response()
        if not req.stream:
            try:
                fins = await asyncio.gather(*[self._whole(request, job, first, lp)
                                              for job, first, lp in zip(jobs, firsts, lps)])
            except ClientGone:
                return JSONResponse(error_body("client disconnected"), status_code=499)
            except BaseException:
                for job in jobs:
                    job.cancel.set()
                raise
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
                    else self.events(jobs[0], firsts[0], cfg, cid, now, chunk, include_usage, splitter, lps[0]))
        else:
            body = self._merged([self.events(job, first, c, cid, now, chunk, include_usage,
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

    async def _merged(self, streams: list, include_usage: bool):
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

    async def events(self, job: Job, ev, cfg: GenConfig, cid: str, now: int, chunk, include_usage: bool,
                     splitter: ToolStream | None = None, lp: O.Logprobs | None = None):
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
                                yield sse(O.chat_delta(self.name, cid, now, delta))
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


def create_app(session, config: ServerConfig | None = None, *, api_key: str | None = None,
               queue_size: int | None = None, max_body: int | None = None,
               log: Callable[[str], None] = S.stderr_note) -> FastAPI:
    """The API over `session`'s pair (loaded here unless it already is). `config` holds the server's settings;
    api_key, queue_size and max_body override it. The caller closes the session after the app has shut down (its
    lifespan stops the worker)."""
    cfg = _config(config, api_key=api_key, queue_size=queue_size, max_body=max_body).check()
    if session.engine is None:
        session.load()
    # requests draft from earlier requests' text only under the same API key (none configured: the user's own cache)
    session.engine.suffix_scope = scope_of(cfg.api_key)
    cfg = cfg.resolved(S.gen_config(session.values()).k, on_gpu=getattr(session.engine.target, "n_gpu_layers", 0) != 0)
    gens = Generations(session, cfg, log)
    engine, base, name, worker = gens.engine, gens.base, gens.name, gens.worker
    created = int(time.time())
    loop_box: list = []

    async def lifespan(app):
        loop_box.append(asyncio.get_running_loop())
        yield
        worker.stop()

    def begin_shutdown() -> None:
        """SIGTERM/SIGINT (from a signal handler): open requests end with "server shutting down"."""
        if loop_box:
            loop_box[0].call_soon_threadsafe(worker.shutdown)  # on the loop: never take a lock in a signal handler

    app = FastAPI(title="localspec", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.add_middleware(Guard, api_key=cfg.api_key, max_body=cfg.max_body)  # innermost
    if cfg.cors_origins:
        local = any(is_local_keyword(o) for o in cfg.cors_origins)
        app.add_middleware(CORSMiddleware, allow_origins=[o for o in cfg.cors_origins if not is_local_keyword(o)],
                           allow_origin_regex=LOCAL_ORIGIN if local else None, allow_methods=["GET", "POST"],
                           allow_headers=["*"], expose_headers=["Retry-After", "X-Request-Id"], max_age=600)
    app.add_middleware(Gate, host_ok=HostCheck(cfg.host, cfg.allowed_hosts or ()), cors_origins=cfg.cors_origins)
    app.add_middleware(A.AnthropicErrors)  # outermost: refusals of every layer in Anthropic's shape there
    app.state.worker = worker
    app.state.model = name
    app.state.metrics = gens.metrics
    app.state.config = cfg
    app.state.begin_shutdown = begin_shutdown

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return invalid(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), code=str(exc.status_code)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request, exc: Exception):  # logged by the server; the client gets one line
        err = APIError(500, f"internal error: {type(exc).__name__}")
        if request.url.path.startswith(A.PATH):  # answered outside the middleware that reshapes the others
            return JSONResponse(A.error_of(err), status_code=500)
        return err.response()

    # ------------------------------------------------------------ endpoints
    def tool_constraint(tools, tool_choice, parallel: bool, output: dict | None, taught: bool):
        """The grammar a request's tools put on the answer: a forced call (tool_choice required / named); under
        auto, a lazy one that holds a call to the tools' schemas once the model starts one, or, when the answer
        must otherwise be JSON (`output`: response_format's schema), one that takes a call or that JSON. None: the
        tools put none (response_format's own applies). `taught`: the model was told the Hermes format
        (for_template)."""
        fmt = "hermes" if taught else None
        forced = TG.choice_grammar(tools, tool_choice, template_text(engine), parallel, fmt=fmt)
        if forced is not None:
            return Grammar(forced, engine.target)
        auto = TG.auto_grammar(tools, tool_choice, template_text(engine), parallel, fmt=fmt, output=output)
        if auto is None:
            return None
        return Grammar(auto[0], engine.target) if auto[1] is None else Lazy(auto[0], engine.target, auto[1])

    def without_tools(msgs: list[dict], grammar: str | None = None):
        """turn() of Generations.run's `again`: the request as under tool_choice none (its prompt builder, and the
        grammar of its output format, if any)."""
        def turn():
            shown, _ = for_template(msgs, None, template_of(engine))
            return (lambda eng: chat_tokens(eng, shown, None)), \
                (Grammar(grammar, engine.target) if grammar is not None else None)
        return turn

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parse_body(request, ChatRequest)
        tools, names = check_tools(req.tools, req.tool_choice)
        msgs = given = chat_messages(req)
        names = reading(names, msgs, req.parallel_tool_calls is not False, req.tool_choice)
        msgs, taught = for_template(msgs, tools, template_of(engine))
        output = schema_of(req.response_format) if tools is not None else None
        con = tool_constraint(tools, req.tool_choice, req.parallel_tool_calls is not False, output, taught)
        return await gens.run(request, req, lambda eng: chat_tokens(eng, msgs, tools),
                              lambda *a: O.chat_chunk(name, *a), lambda *a: O.chat_whole(name, *a),
                              tools=names if tools is not None else None, logprobs=O.chat_logprobs,
                              constraint=con, constraint_again=None if con is None else lambda: tool_constraint(
                                  tools, req.tool_choice, req.parallel_tool_calls is not False, output, taught),
                              again=(names, without_tools(given)) if tools is not None else None)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse_body(request, CompletionRequest)
        prompt = completion_prompt(req)
        return await gens.run(request, req, lambda eng: eng.raw_prompt(prompt),
                              lambda *a: O.completion_chunk(name, *a), lambda *a: O.completion_whole(name, *a),
                              logprobs=O.completion_logprobs)

    @app.post("/v1/responses")
    async def responses(request: Request):
        req = await parse_body(request, R.ResponsesRequest)
        msgs = given = R.messages_of(req)
        if req.max_output_tokens is not None:
            req.max_tokens = req.max_output_tokens
        tools, choice = R.chat_tools(req)
        tools, names = check_tools(tools, choice)
        names = reading(names, msgs, req.parallel_tool_calls is not False, choice)
        msgs, taught = for_template(msgs, tools, template_of(engine))
        output, grammar = R.output_format(req)
        con = tool_constraint(tools, choice, req.parallel_tool_calls is not False, output, taught) \
            if tools is not None else None
        if con is None and grammar is not None:
            con = Grammar(grammar, engine.target)
        found = names if tools is not None else None
        return await gens.run(request, req, lambda eng: chat_tokens(eng, msgs, tools), None,
                              R.whole(name, req, found), stream=lambda *a: R.stream(name, req, found, *a),
                              constraint=con,
                              again=(names, without_tools(given, grammar)) if found is not None else None)

    def anthropic_request(req: A.MessagesRequest, grammar: bool = True):
        """(prompt builder, the tools' names or None, the tool grammar, Generations.run's `again`) of a Messages
        request, as chat's."""
        msgs = given = A.messages_of(req)
        tools, choice, parallel = A.chat_tools(req)
        tools, names = check_tools(tools, choice)
        names = reading(names, msgs, parallel, choice)
        msgs, taught = for_template(msgs, tools, template_of(engine))
        con = json_grammar = None
        if grammar:  # tools and a JSON output format together: a call or that JSON, as on /v1/responses
            output, json_grammar = A.output_format(req)
            con = tool_constraint(tools, choice, parallel, output, taught) if tools is not None else None
            if con is None and json_grammar is not None:
                con = Grammar(json_grammar, engine.target)
        again = (names, without_tools(given, json_grammar)) if tools is not None else None
        return (lambda eng: chat_tokens(eng, msgs, tools)), (names if tools is not None else None), con, again

    @app.post("/v1/messages")
    async def messages(request: Request):
        req = await parse_body(request, A.MessagesRequest)
        build, found, con, again = anthropic_request(req)
        return await gens.run(request, req, build, None, A.whole(name, req, found, engine.target),
                              stream=lambda *a: A.stream(name, req, found, engine.target, *a), constraint=con,
                              early=True, again=again)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        req = await parse_body(request, A.MessagesRequest)
        if req.max_tokens is None:
            req.max_tokens = 1  # count_tokens takes none
        build = anthropic_request(req, grammar=False)[0]
        try:
            tokens = await asyncio.to_thread(build, engine)
        except UsageError as exc:
            raise setting_error(exc) from None
        except LocalspecError as exc:
            raise setting_error(exc, 500) from None
        return {"input_tokens": len(tokens)}

    def model_object() -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "localspec",
                "localspec": {"target": engine.target.name,
                              "draft": engine.draft.name if engine.draft is not None else None,
                              "method": base["method"], "k": S.gen_config(base).k, "n_ctx": engine.target.n_ctx,
                              "max_k": cfg.max_k, "aliases": sorted(gens.accepted_names - {name})}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_object()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        gens.check_model(model)
        return model_object()  # the served id, whatever name was asked for (unless strict_model)

    if gens.metrics is not None:
        @app.get("/metrics")
        async def metrics():
            return Response(gens.metrics.render(), media_type=gens.metrics.content_type)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "generating": worker.active > 0, "queued": worker.waiting,
                "queue_size": worker.queue_size, "generations": dict(worker.counts),
                "slots": worker.parallel, "active_slots": worker.active, "kv_layout": worker.kv_layout}

    return app
