"""`localspec serve`: an OpenAI-compatible HTTP API over one loaded pair, with each response's speculation stats.

It sits on the session layer (settings, model resolution, loading, the machine-wide generation slot) and the engine.
The engine is not thread-safe: one worker thread runs every generation in turn; requests wait in a bounded queue
(full: 503 with Retry-After). A client that goes away cancels its generation within one decoding step. A request
that extends an earlier conversation reuses the target's cached prefix (Model.sync keeps the common prefix).

Endpoints: POST /v1/chat/completions, POST /v1/completions (streamed as server-sent events or not), GET /v1/models,
GET /health. Errors are OpenAI-style objects {"error": {"message", "type", "param", "code"}}, never a traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import math
import queue
import socket
import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from localspec import session as S
from localspec.core.engine import Finished, GenConfig, Piece
from localspec.errors import ContextOverflowError, LocalspecError, UsageError

DEFAULT_QUEUE = 8  # requests that may wait while one generates
DEFAULT_MAX_BODY = 4 * 1024 * 1024  # bytes
MAX_STOPS = 16
POLL_S = 0.1  # how often a waiting non-streamed request checks that its client is still there
ALIASES = ("localspec",)  # model names accepted besides the served model's id and its target file name


# ----------------------------------------------------------------- errors
class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# settings a UsageError message starts with -> the request parameter it concerns
_PARAM_OF = {"temperature": "temperature", "top-p": "top_p", "seed": "seed", "max tokens": "max_tokens"}


def usage_error(exc: UsageError) -> APIError:
    msg = str(exc)
    param = next((p for prefix, p in _PARAM_OF.items() if msg.startswith(prefix)), None)
    return APIError(400, msg, param=param)


# ----------------------------------------------------------------- request bodies
class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send fields we do not use (user, logit_bias ...)


class StreamOptions(_Body):
    include_usage: bool = False


class SpeculationOptions(BaseModel):
    """localspec's own per-request options (the `localspec` field; `extra_body={"localspec": {...}}` in the openai
    package): they override the server's settings for this request only."""
    model_config = ConfigDict(extra="forbid")  # a misspelt option is an error, not silently the default
    method: Optional[str] = None
    k: Optional[int] = None
    exactness: Optional[str] = None


class _Common(_Body):
    localspec: Optional[SpeculationOptions] = None
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Any = None  # str or list of str: checked by hand for a clear message
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = None


class ChatMessage(_Body):
    role: str
    content: Any = None  # str, a list of text parts, or null (an assistant turn with tool calls)


class ChatRequest(_Common):
    messages: list[ChatMessage]


class CompletionRequest(_Common):
    prompt: Any  # str or a list of one str


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def chat_messages(req: ChatRequest) -> list[dict]:
    if not req.messages:
        raise APIError(400, "messages must hold at least one message", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        role = ROLES.get(m.role)
        if role is None:
            raise APIError(400, f"messages[{i}].role {m.role!r} is not supported; use system, user or assistant",
                           param=f"messages[{i}].role")
        c = m.content
        if c is None:
            text = ""
        elif isinstance(c, str):
            text = c
        elif isinstance(c, list):
            parts = []
            for j, part in enumerate(c):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise APIError(400, f"messages[{i}].content[{j}]: only text parts are supported",
                                   param=f"messages[{i}].content")
                parts.append(part["text"])
            text = "\n".join(parts)
        else:
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts",
                           param=f"messages[{i}].content")
        out.append({"role": role, "content": text})
    return out


def completion_prompt(req: CompletionRequest) -> str:
    p = req.prompt
    if isinstance(p, list) and len(p) == 1:
        p = p[0]
    if isinstance(p, list):
        raise APIError(400, "prompt must be a string or a list of one string (batches are not supported)", param="prompt")
    if not isinstance(p, str):
        raise APIError(400, "prompt must be a string", param="prompt")
    if p == "":
        raise APIError(400, "prompt is empty", param="prompt")
    return p


def stops(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise APIError(400, "stop must be a string or a list of strings", param="stop")
    if len(value) > MAX_STOPS:
        raise APIError(400, f"stop takes at most {MAX_STOPS} strings", param="stop")
    return [s for s in value if s]


# ----------------------------------------------------------------- the worker
@dataclass
class Job:
    build: Callable[[Any], list[int]]  # engine -> prompt tokens (run in the worker: the engine is not thread-safe)
    cfg: GenConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancel: threading.Event = field(default_factory=threading.Event)
    checked: float = field(default_factory=time.monotonic)  # when the client's connection was last checked

    def post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancel.set()


class Worker:
    """Runs generations one at a time on the session's engine, in the order they came."""

    def __init__(self, session, queue_size: int, log: Callable[[str], None]) -> None:
        if queue_size < 1:
            raise UsageError(f"queue size must be >= 1, got {queue_size}")
        self.session = session
        self.queue_size = queue_size
        self.log = log
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.waiting = 0  # queued, not started
        self.current: Job | None = None
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0}
        self.recent_s: deque = deque(maxlen=16)  # durations of recent generations (for Retry-After)
        self._thread = threading.Thread(target=self._run, name="localspec-serve", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.waiting >= self.queue_size:
                self.counts["rejected"] += 1
                raise APIError(503, f"server busy: {self.waiting} requests are waiting already; retry later",
                               type_="server_error", code="queue_full", headers={"Retry-After": str(self.retry_after())})
            self.waiting += 1
        self._q.put(job)

    def retry_after(self) -> int:
        mean = sum(self.recent_s) / len(self.recent_s) if self.recent_s else 1.0
        return max(1, min(60, math.ceil(mean * (self.waiting + 1))))

    def stop(self, timeout: float = 30.0) -> bool:
        """Cancel the running and queued generations and end the thread; True when it ended."""
        with self._lock:
            if self.current is not None:
                self.current.cancel.set()
        while True:
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel.set()
                job.post(APIError(503, "server shutting down", code="shutting_down"))
        self._q.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            with self._lock:
                self.waiting -= 1
                self.current = job
            try:
                self._one(job)
            finally:
                with self._lock:
                    self.current = None

    def _one(self, job: Job) -> None:
        if job.cancel.is_set():  # the client left while queued
            self.counts["cancelled"] += 1
            return
        t0 = time.perf_counter()
        engine = self.session.engine
        try:
            tokens = job.build(engine)
            with S.generation_slot(waiting=self.log):
                for ev in engine.generate(tokens, job.cfg, cancel=job.cancel):
                    job.post(ev)
                    if isinstance(ev, Finished):
                        self.counts["cancelled" if ev.finish_reason == "cancelled" else "completed"] += 1
        except (UsageError, ContextOverflowError) as exc:
            self.counts["failed"] += 1
            job.post(usage_error(exc) if isinstance(exc, UsageError) else APIError(400, str(exc), code="context_length_exceeded"))
        except LocalspecError as exc:
            self.counts["failed"] += 1
            job.post(APIError(500, str(exc)))
        except Exception as exc:  # a bug must not kill the worker: log it here, answer one line
            self.counts["failed"] += 1
            self.log("localspec serve: generation failed:\n" + traceback.format_exc().rstrip())
            job.post(APIError(500, f"internal error: {type(exc).__name__}"))
        finally:
            self.recent_s.append(time.perf_counter() - t0)


# ----------------------------------------------------------------- the response bodies
def localspec_stats(stats, cfg: GenConfig) -> dict:
    d = {
        "tokens_per_second": stats.measured_rate(),  # the display also hides samples under 50 ms
        "acceptance_rate": stats.acceptance_rate,
        "tokens_per_pass": stats.tokens_per_pass,
        "mean_accepted_length": stats.mean_accepted_length,
        "method": stats.main_method,
        "requested_method": cfg.method,
        "k": stats.k_cap,
        "requested_k": cfg.k,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "target_passes": stats.target_passes,
        "ttft_s": stats.ttft_s,
        "elapsed_s": stats.elapsed_s,
        "steps_by_method": dict(stats.method_used),
    }
    for key in ("exactness", "exactness_reason"):
        value = getattr(stats, key, None)
        if value is not None:
            d[key] = value
    if stats.reason:
        d["controller"] = stats.reason
    return d


def usage(stats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens},
    }


def invalid(errors) -> APIError:
    """One 400 from pydantic's validation errors: the first one's place and message."""
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    where = ".".join(loc)
    msg = f"{where}: {first.get('msg', 'invalid value')}" if where else str(first.get("msg", "invalid request body"))
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more)"
    return APIError(400, msg, param=loc[0] if loc else None)


async def parse_body(request: Request, model: type[BaseModel]):
    """The JSON body as `model`, whatever the Content-Type says (curl -d sends form encoding)."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid(exc.errors()) from None


class ClientGone(Exception):
    pass


async def next_event(request: Request, job: Job):
    """The job's next event. Checks at least every POLL_S that the client is still connected, whether events keep
    coming (a fast model) or not; when it is gone, cancels the job (the engine stops within one step) and raises
    ClientGone."""

    async def check() -> None:
        job.checked = time.monotonic()
        if await request.is_disconnected():
            job.cancel.set()
            raise ClientGone

    if time.monotonic() - job.checked >= POLL_S:
        await check()
    getter = asyncio.ensure_future(job.events.get())
    try:
        while True:
            done, _ = await asyncio.wait({getter}, timeout=POLL_S)
            if done:
                return getter.result()
            await check()
    finally:
        if not getter.done():
            getter.cancel()


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# ----------------------------------------------------------------- the app
class Guard:
    """ASGI middleware: the API key (every request but GET /health) and the body size limit, before FastAPI reads
    anything. The body is read here (at most max_body bytes) and handed on."""

    def __init__(self, app, api_key: str | None, max_body: int) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_body = max_body

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.key is not None and not (scope["method"] == "GET" and scope["path"] == "/health"):
            auth = headers.get(b"authorization", b"")
            given = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(given, self.key):
                msg = "missing API key: send Authorization: Bearer KEY" if not given else "incorrect API key"
                return await self._reply(send, 401, error_body(msg, code="invalid_api_key"), {"WWW-Authenticate": "Bearer"})
        too_big = error_body(f"request body is larger than {self.max_body} bytes", code="request_too_large")
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return await self._reply(send, 400, error_body("bad Content-Length header"))
            if n > self.max_body:
                return await self._reply(send, 413, too_big)
        chunks, total, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            total += len(body)
            if total > self.max_body:
                return await self._reply(send, 413, too_big)
            chunks.append(body)
            more = msg.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then the connection's own messages: http.disconnect

        await self.app(scope, replay, send)

    @staticmethod
    async def _reply(send, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        hs = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        hs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": hs})
        await send({"type": "http.response.body", "body": data})


def model_id(session) -> str:
    """The served model's name: the pair name, or the target's file name."""
    return session.pair.name if session.pair is not None else session.target_path.name


def create_app(session, *, api_key: str | None = None, queue_size: int = DEFAULT_QUEUE,
               max_body: int = DEFAULT_MAX_BODY, log: Callable[[str], None] = S.stderr_note) -> FastAPI:
    """The API over `session`'s pair (loaded here unless it already is). The caller closes the session after the
    app has shut down (its lifespan stops the worker)."""
    if max_body < 1:
        raise UsageError(f"body limit must be >= 1 byte, got {max_body}")
    if session.engine is None:
        session.load()
    engine = session.engine
    base = session.values()  # settings are resolved once: the request's own values change only its generation
    name = model_id(session)
    accepted_names = {name, session.target_path.name, session.target_path.stem, *ALIASES}
    created = int(time.time())
    worker = Worker(session, queue_size, log)

    async def lifespan(app):
        yield
        worker.stop()

    app = FastAPI(title="localspec", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.add_middleware(Guard, api_key=api_key, max_body=max_body)
    app.state.worker = worker
    app.state.model = name

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
        return APIError(500, f"internal error: {type(exc).__name__}").response()

    def gen_config(req: _Common) -> GenConfig:
        if req.model is not None and req.model not in accepted_names:
            raise APIError(400, f"model {req.model!r} is not served here; this server serves {name!r}",
                           param="model", code="model_not_found")
        if req.n is not None and req.n != 1:
            raise APIError(400, "n must be 1 (one choice per request)", param="n")
        changes: dict[str, Any] = {}
        mt = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if mt is not None:
            changes["max_tokens"] = mt
        for key in ("temperature", "top_p", "seed"):
            if getattr(req, key) is not None:
                changes[key] = getattr(req, key)
        if req.localspec is not None:
            for key, setting in (("method", "method"), ("k", "draft_tokens"), ("exactness", "exactness")):
                if getattr(req.localspec, key) is not None:
                    changes[setting] = getattr(req.localspec, key)
        v = {**base, **changes}
        try:
            S.validate(v)
            cfg = S.gen_config(v, stops(req.stop))
            engine.resolve_method(cfg)  # e.g. method draft without a draft model: 400 before the request queues
            return cfg
        except UsageError as exc:
            raise usage_error(exc) from None

    async def run(request: Request, req: _Common, build, chunk, whole):
        cfg = gen_config(req)
        loop = asyncio.get_running_loop()
        job = Job(build, cfg, loop, asyncio.Queue())
        worker.submit(job)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        cid = uuid.uuid4().hex[:24]
        now = int(time.time())
        try:
            first = await next_event(request, job)
        except ClientGone:
            return JSONResponse(error_body("client disconnected"), status_code=499)
        except BaseException:
            job.cancel.set()
            raise
        if isinstance(first, APIError):
            return first.response()
        if not req.stream:
            ev = first
            try:
                while not isinstance(ev, Finished):
                    if isinstance(ev, APIError):
                        return ev.response()
                    ev = await next_event(request, job)
            except ClientGone:
                return JSONResponse(error_body("client disconnected"), status_code=499)
            except BaseException:
                job.cancel.set()
                raise
            return JSONResponse(whole(cid, now, ev, cfg))

        async def events():
            ev = first
            try:
                yield sse(chunk(cid, now, None, None))  # the opening chunk (chat: the assistant role)
                while True:
                    if isinstance(ev, APIError):
                        yield sse(ev.body())
                        break
                    if isinstance(ev, Piece):
                        if ev.text:
                            yield sse(chunk(cid, now, ev.text, None))
                    elif isinstance(ev, Finished):
                        last = chunk(cid, now, None, ev.finish_reason)
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
                yield b"data: [DONE]\n\n"
            finally:
                job.cancel.set()  # a no-op once finished; stops the generation when the client went away

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------ endpoints
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parse_body(request, ChatRequest)
        msgs = chat_messages(req)

        def chunk(cid, now, text, finish):
            delta = {} if finish else ({"role": "assistant", "content": ""} if text is None else {"content": text})
            return {"id": f"chatcmpl-{cid}", "object": "chat.completion.chunk", "created": now, "model": name,
                    "system_fingerprint": None,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        def whole(cid, now, fin, cfg):
            return {"id": f"chatcmpl-{cid}", "object": "chat.completion", "created": now, "model": name,
                    "system_fingerprint": None,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": fin.text},
                                 "logprobs": None, "finish_reason": fin.finish_reason}],
                    "usage": usage(fin.stats), "localspec": localspec_stats(fin.stats, cfg)}

        return await run(request, req, lambda eng: eng.chat_prompt(msgs), chunk, whole)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse_body(request, CompletionRequest)
        prompt = completion_prompt(req)

        def chunk(cid, now, text, finish):
            return {"id": f"cmpl-{cid}", "object": "text_completion", "created": now, "model": name,
                    "system_fingerprint": None,
                    "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}

        def whole(cid, now, fin, cfg):
            return {"id": f"cmpl-{cid}", "object": "text_completion", "created": now, "model": name,
                    "system_fingerprint": None,
                    "choices": [{"index": 0, "text": fin.text, "logprobs": None, "finish_reason": fin.finish_reason}],
                    "usage": usage(fin.stats), "localspec": localspec_stats(fin.stats, cfg)}

        return await run(request, req, lambda eng: eng.raw_prompt(prompt), chunk, whole)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": created, "owned_by": "localspec",
            "localspec": {"target": engine.target.name, "draft": engine.draft.name if engine.draft is not None else None,
                          "method": base["method"], "k": S.gen_config(base).k, "n_ctx": engine.target.n_ctx,
                          "aliases": sorted(accepted_names - {name})},
        }]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "generating": worker.current is not None, "queued": worker.waiting,
                "queue_size": worker.queue_size, "generations": dict(worker.counts)}

    return app


# ----------------------------------------------------------------- running it
def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, port: int, api_key: str | None) -> str | None:
    if is_loopback(host):
        return None
    who = f"anyone who can reach this machine on {host}:{port}"
    if api_key:
        return (f"warning: listening on {host}:{port}: {who} can reach the API (requests need the API key; "
                "plain HTTP, so the key and the text travel unencrypted)")
    return (f"warning: listening on {host}:{port}: {who} can use the API (generate text with the loaded model) "
            "WITHOUT authentication; pass --api-key or set LOCALSPEC_API_KEY")


def bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise UsageError(f"port must be between 0 and 65535, got {port}")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"cannot resolve host {host!r}: {exc.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise LocalspecError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


try:
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            # Ctrl-C / SIGTERM is how a server is stopped: shut down gracefully and return (uvicorn would raise the
            # signal again afterwards, skipping the worker's stop and the models' close)
            getattr(self, "_captured_signals", []).clear()
except ImportError:  # pragma: no cover - fastapi without uvicorn
    _Server = None


def serve(session, *, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
          queue_size: int = DEFAULT_QUEUE, max_body: int = DEFAULT_MAX_BODY,
          log: Callable[[str], None] = S.stderr_note) -> None:
    """`localspec serve`: bind, load the pair once, announce the URL, serve until Ctrl-C."""
    import uvicorn

    if _Server is None:  # pragma: no cover
        raise LocalspecError("uvicorn is not installed: pip install uvicorn")
    if api_key is not None and api_key.strip() == "":
        raise UsageError("the API key must not be empty")
    if queue_size < 1:
        raise UsageError(f"--queue must be >= 1, got {queue_size}")
    session.check()
    sock = bind(host, port)
    stopped, app = False, None
    try:
        session.announce = session.announce or log
        engine = session.load()
        if engine.dropped_draft:
            log(f"warning: {engine.dropped_draft}; using prompt lookup")
        if engine.template_warning:
            log(f"warning: {engine.template_warning}")
        v = session.values()
        if v["method"] != "none":
            engine.exact_k(S.gen_config(v).k)  # the one-time exactness probe, before the first request
        app = create_app(session, api_key=api_key, queue_size=queue_size, max_body=max_body, log=log)
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=3,
                                lifespan="on")
        server = _Server(config)
        real_port = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        warning = exposure_warning(host, real_port, api_key)
        if warning:
            log(warning)
        sock.listen(2048)  # from here on connections wait in the backlog until uvicorn accepts them
        log(f"localspec serve: http://{shown}:{real_port}/v1 (model {app.state.model})")
        server.run(sockets=[sock])
        stopped = app.state.worker.stop(timeout=60)
        log("localspec serve: stopped" if stopped else "localspec serve: a generation did not stop in time")
    finally:
        sock.close()
        if app is None or stopped:
            session.close()  # never under a generation that is still running
