"""`localspec serve`: an OpenAI-compatible HTTP API over one loaded pair, with each response's speculation stats.

It sits on the session layer (settings, model resolution, loading, the machine-wide generation slot) and the engine.
Generations run on a worker thread (server/queue.py), side by side in batch slots with --parallel N. A request that
extends an earlier conversation reuses the target's cached prefix. Who may call it: server/guard.py. This module
holds the app and its routes; a request's life from its fields to its answer is server/lifecycle.py, its answer
streamed as server-sent events server/streaming.py.

Endpoints: POST /v1/chat/completions, POST /v1/completions (streamed as server-sent events or not), GET /v1/models,
POST /v1/responses (server/responses.py), POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages
API: server/anthropic_request.py), GET /v1/models/{id}, GET /health, GET /metrics (Prometheus; server/metrics.py).
Any model name is served by the loaded pair (ServerConfig.strict_model: 404). Errors are OpenAI-style objects
{"error": {"message", "type", "param", "code"}} (Anthropic's shape under /v1/messages), never a traceback, and name
the request's JSON fields. Starting and stopping the server: server/main.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from localspec import session as S
from localspec.errors import LocalspecError, UsageError
from localspec.server import anthropic_answer as AA
from localspec.server import anthropic_errors as AE
from localspec.server import anthropic_request as AR
from localspec.server import openai as O
from localspec.server import responses as R
from localspec.server import tool_grammar as TG
from localspec.server.config import ServerConfig
from localspec.server.grammar import Grammar, Lazy, schema_of
from localspec.server.guard import LOCAL_ORIGIN, Gate, Guard, HostCheck, is_local_keyword
from localspec.server.lifecycle import Generations
from localspec.server.openai import APIError, error_body, invalid, setting_error
from localspec.server.schemas import ChatRequest, CompletionRequest, chat_messages, completion_prompt, parse_body
from localspec.server.tool_calls import reading
from localspec.server.tool_template import check_tools, for_template
from localspec.store.suffixcache import scope_of


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


def _config(config: ServerConfig | None, **overrides) -> ServerConfig:
    given = {k: v for k, v in overrides.items() if v is not None}
    return (config or ServerConfig()).replace(**given) if given else (config or ServerConfig())


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
    app.add_middleware(AE.AnthropicErrors)  # outermost: refusals of every layer in Anthropic's shape there
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
        if request.url.path.startswith(AE.PATH):  # answered outside the middleware that reshapes the others
            return JSONResponse(AE.error_of(err), status_code=500)
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

    def anthropic_request(req: AR.MessagesRequest, grammar: bool = True):
        """(prompt builder, the tools' names or None, the tool grammar, Generations.run's `again`) of a Messages
        request, as chat's."""
        msgs = given = AR.messages_of(req)
        tools, choice, parallel = AR.chat_tools(req)
        tools, names = check_tools(tools, choice)
        names = reading(names, msgs, parallel, choice)
        msgs, taught = for_template(msgs, tools, template_of(engine))
        con = json_grammar = None
        if grammar:  # tools and a JSON output format together: a call or that JSON, as on /v1/responses
            output, json_grammar = AR.output_format(req)
            con = tool_constraint(tools, choice, parallel, output, taught) if tools is not None else None
            if con is None and json_grammar is not None:
                con = Grammar(json_grammar, engine.target)
        again = (names, without_tools(given, json_grammar)) if tools is not None else None
        return (lambda eng: chat_tokens(eng, msgs, tools)), (names if tools is not None else None), con, again

    @app.post("/v1/messages")
    async def messages(request: Request):
        req = await parse_body(request, AR.MessagesRequest)
        build, found, con, again = anthropic_request(req)
        return await gens.run(request, req, build, None, AA.whole(name, req, found, engine.target),
                              stream=lambda *a: AA.stream(name, req, found, engine.target, *a), constraint=con,
                              early=True, again=again)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        req = await parse_body(request, AR.MessagesRequest)
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
