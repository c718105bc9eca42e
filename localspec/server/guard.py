"""Who may talk to the server, checked as ASGI middleware before FastAPI reads anything.

`Gate` (outermost): the Host header must name this server (against DNS rebinding: a web page whose name resolves to
127.0.0.1 sends its own name as Host) and an Origin header, which browsers send with every cross-origin request,
must be one of the allowed CORS origins (none by default): a web page the user visits cannot drive the local API.
Then Starlette's CORSMiddleware (only when origins are allowed) answers their preflights, without the API key, and
adds the CORS headers. `Guard` (innermost): the API key (every request but GET /health; `Authorization: Bearer KEY`
or Anthropic's `x-api-key: KEY`), `Content-Type: application/json` on POST bodies (a browser can send text/plain
and form bodies cross-origin without asking first), and the body size limit; the body is read here (at most
max_body bytes) and handed on."""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
import socket
import uuid

from localspec.server.config import CORS_ANY, CORS_LOCAL, LOOPBACK_NAMES
from localspec.server.openai import error_body

WILDCARDS = ("", "0.0.0.0", "::", "[::]")


async def reply(send, status: int, body: dict, headers: dict | None = None) -> None:
    data = json.dumps(body).encode()
    hs = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    hs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hs})
    await send({"type": "http.response.body", "body": data})


def host_name(value: str) -> str:
    """The name part of a Host header or a bound address, lowercased: 'LocalHost:8080' -> 'localhost',
    '[::1]:8080' and '::1' -> '[::1]'."""
    v = value.strip().lower().rstrip(".")
    if v.startswith("["):
        return v[: v.find("]") + 1] if "]" in v else v
    if v.count(":") > 1:  # a bare IPv6 address (a bound host, never a Host header)
        return f"[{v}]"
    return v.split(":", 1)[0].rstrip(".")


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
        return True
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class HostCheck:
    """Which Host headers are this server. Always: the bound host, localhost, 127.0.0.1, [::1] (any port), and
    `allowed` ("*": any). Bound to a non-loopback address, also any IP address and this machine's name (the names
    remote clients use; a rebinding attack needs a domain name of its own, never an IP address)."""

    def __init__(self, bound: str, allowed=()) -> None:
        self.any = "*" in allowed
        self.names = {host_name(bound), *LOOPBACK_NAMES, *(host_name(a) for a in allowed if a != "*")}
        self.any_ip = not is_loopback(bound.strip("[]") or "0.0.0.0")
        if self.any_ip:
            try:
                me = socket.gethostname().lower()
            except OSError:  # pragma: no cover
                me = ""
            if me:
                self.names |= {me, me.split(".")[0], me.split(".")[0] + ".local"}

    def __call__(self, header: str | None) -> bool:
        if self.any or header is None:  # no Host header: HTTP/1.0, never a browser
            return True
        name = host_name(header)
        return name in self.names or (self.any_ip and is_ip(name))


def origin_of(value: str) -> str:
    return value.strip().lower().rstrip("/")


# the origins --cors-origins localhost lets in: a page on this machine, any port (for CORSMiddleware and the Gate)
LOCAL_ORIGIN = r"(?i)https?://(?:localhost|127\.0\.0\.1|\[::1\])(?::\d{1,5})?"


def is_local_keyword(entry: str) -> bool:
    return entry.strip().lower() == CORS_LOCAL


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id(given: bytes | None) -> bytes:
    """A client's own X-Request-Id when it is a plain token (kept for its logs), else a new one."""
    if given is not None and _REQUEST_ID.fullmatch(given.decode("latin-1")):
        return given
    return f"req_{uuid.uuid4().hex}".encode()


class Gate:
    """ASGI middleware: the Host and Origin checks (see the module doc); 403 with an OpenAI error body. Every
    response, refusals included, carries an X-Request-Id header."""

    def __init__(self, app, host_ok: HostCheck, cors_origins=()) -> None:
        self.app = app
        self.host_ok = host_ok
        self.any_origin = CORS_ANY in cors_origins
        self.local = any(is_local_keyword(o) for o in cors_origins)
        self.origins = {origin_of(o) for o in cors_origins if o != CORS_ANY and not is_local_keyword(o)}

    def origin_ok(self, origin: str) -> bool:
        o = origin_of(origin)
        return self.any_origin or o in self.origins or (self.local and re.fullmatch(LOCAL_ORIGIN, o) is not None)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        rid = request_id(headers.get(b"x-request-id"))
        scope.setdefault("state", {})["request_id"] = rid.decode()
        inner_send = send

        async def send(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
            await inner_send(message)

        host = headers.get(b"host")
        host = host.decode("latin-1") if host is not None else None
        if not self.host_ok(host):
            return await reply(send, 403, error_body(
                f"Host {host!r} is not this server: requests must name it (localhost, its address) or one of its "
                "allowed hosts (LOCALSPEC_ALLOWED_HOSTS)", code="host_not_allowed"))
        origin = headers.get(b"origin")
        if origin is not None and not self.origin_ok(origin.decode("latin-1")):
            shown = origin.decode("latin-1")
            return await reply(send, 403, error_body(
                f"requests from web pages at {shown!r} are refused: that origin is not among this server's allowed "
                "CORS origins", code="origin_not_allowed"))
        return await self.app(scope, receive, send)


def is_json(content_type: bytes | None) -> bool:
    if content_type is None:
        return False
    media = content_type.decode("latin-1").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class Guard:
    """ASGI middleware: the API key, the JSON content type and the body size limit (see the module doc)."""

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
            bearer = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            given = [k for k in (bearer, headers.get(b"x-api-key", b"").strip()) if k]  # x-api-key: Anthropic's
            if not any([hmac.compare_digest(k, self.key) for k in given]):  # both compared, whichever matches
                msg = ("missing API key: send Authorization: Bearer KEY (or x-api-key: KEY)" if not given
                       else "incorrect API key")
                return await reply(send, 401, error_body(msg, code="invalid_api_key"), {"WWW-Authenticate": "Bearer"})
        if scope["method"] in ("POST", "PUT", "PATCH") and not is_json(headers.get(b"content-type")):
            ct = headers.get(b"content-type")
            said = f"Content-Type {ct.decode('latin-1')!r}" if ct is not None else "no Content-Type"
            return await reply(send, 415, error_body(
                f"the body must be JSON sent with Content-Type: application/json (got {said})",
                code="unsupported_media_type"))
        too_big = error_body(f"request body is larger than {self.max_body} bytes", code="request_too_large")
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return await reply(send, 400, error_body("bad Content-Length header"))
            if n > self.max_body:
                return await reply(send, 413, too_big)
        chunks, total, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            total += len(body)
            if total > self.max_body:
                return await reply(send, 413, too_big)
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
