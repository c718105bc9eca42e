"""Errors under /v1/messages in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}` with
Anthropic's status, whichever layer refused the request (`AnthropicErrors`), the message naming the field it is
about (Anthropic's errors have no `param`)."""

from __future__ import annotations

import json

from localspec.server.openai import APIError

PATH = "/v1/messages"  # the endpoint and count_tokens under it: errors there are in Anthropic's shape


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
