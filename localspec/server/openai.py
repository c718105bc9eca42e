"""The OpenAI wire shapes: error objects, usage, localspec's per-response stats, server-sent events. Errors name
the request's JSON fields (never a CLI flag): a setting error is worded with `json_field_of`."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from localspec.core.report import openai_usage, server_object
from localspec.errors import LocalspecError

# settings a request can set -> the JSON field that sets them
REQUEST_FIELDS = {
    "draft_tokens": "localspec.k",
    "method": "localspec.method",
    "exactness": "localspec.exactness",
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "logit_bias": "logit_bias",
}
# settings no request sets, in words a client can act on
OTHER_WORDS = {"draft": "none is loaded on this server", "ctx_size": "a server context size of"}


def json_field_of(setting: str) -> str:
    """How the API names a setting: its request field, or what it is on this server."""
    return REQUEST_FIELDS.get(setting) or OTHER_WORDS.get(setting) or f"the server's {setting} setting"


# how deeply request JSON may nest (the body, and tool-call arguments sent as JSON text): the chat template, JSON
# Schema walks and the prompt's plain-text walk recurse once or more per level, so deeper values would reach
# Python's recursion limit; a value deeper than this is a 400 before any of them runs
MAX_DEPTH = 128


def too_deep(value, limit: int = MAX_DEPTH) -> bool:
    """Whether a JSON value nests more than `limit` objects or arrays inside each other (counted without
    recursion: the value may be arbitrarily deep)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if items is None:
            continue
        if depth > limit:
            return True
        stack.extend((x, depth + 1) for x in items if isinstance(x, (dict, list)))
    return False


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


def setting_error(exc: LocalspecError, status: int = 400, code: str | None = None) -> APIError:
    """A domain error as an API error: the message in the API's words, param the first setting's JSON field."""
    param = next((REQUEST_FIELDS[s] for s in exc.settings if s in REQUEST_FIELDS), None)
    return APIError(status, exc.worded(json_field_of), param=param, code=code)


def invalid(errors) -> APIError:
    """One 400 from pydantic's validation errors: the first one's place and message."""
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    where = ".".join(loc)
    msg = f"{where}: {first.get('msg', 'invalid value')}" if where else str(first.get("msg", "invalid request body"))
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more)"
    return APIError(400, msg, param=loc[0] if loc else None)


# the per-response figures come from the one report of a generation (core/report.py)
usage = openai_usage


def localspec_stats(stats, cfg) -> dict:
    """The `localspec` object of a response; `retried`: why the answer was generated twice (server/tool_retry.py Retry),
    its figures those of both generations."""
    d = server_object(stats, cfg)
    if getattr(stats, "retried", None):
        d["retried"] = stats.retried
    return d


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


# ----------------------------------------------------------------- response bodies of the two endpoints
def chat_chunk(name: str, cid: str, now: int, text, finish) -> dict:
    delta = {} if finish else ({"role": "assistant", "content": ""} if text is None else {"content": text})
    return {"id": f"chatcmpl-{cid}", "object": "chat.completion.chunk", "created": now, "model": name,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def chat_delta(name: str, cid: str, now: int, delta: dict) -> dict:
    return {"id": f"chatcmpl-{cid}", "object": "chat.completion.chunk", "created": now, "model": name,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}


def chat_whole(name: str, cid: str, now: int, fin, cfg) -> dict:
    return {"id": f"chatcmpl-{cid}", "object": "chat.completion", "created": now, "model": name,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": fin.text},
                         "logprobs": None, "finish_reason": fin.finish_reason}],
            "usage": usage(fin.stats), "localspec": localspec_stats(fin.stats, cfg)}


def completion_chunk(name: str, cid: str, now: int, text, finish) -> dict:
    return {"id": f"cmpl-{cid}", "object": "text_completion", "created": now, "model": name,
            "system_fingerprint": None,
            "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}


def completion_whole(name: str, cid: str, now: int, fin, cfg) -> dict:
    return {"id": f"cmpl-{cid}", "object": "text_completion", "created": now, "model": name,
            "system_fingerprint": None,
            "choices": [{"index": 0, "text": fin.text, "logprobs": None, "finish_reason": fin.finish_reason}],
            "usage": usage(fin.stats), "localspec": localspec_stats(fin.stats, cfg)}


# ----------------------------------------------------------------- logprobs (gathered as the events come: Logprobs)
def _top_entry(r: dict) -> dict:
    return {"token": r["token"], "logprob": r["logprob"], "bytes": r["bytes"]}


def chat_logprobs(records: list[dict]) -> dict:
    """choices[i].logprobs of a chat answer (or chunk): one entry per token with its top alternatives."""
    return {"content": [{**_top_entry(r), "top_logprobs": [_top_entry(a) for a in r["top"]]} for r in records],
            "refusal": None}


def completion_logprobs(records: list[dict]) -> dict:
    """choices[i].logprobs of a legacy completion: parallel lists, text_offset counted in characters."""
    return {"tokens": [r["token"] for r in records], "token_logprobs": [r["logprob"] for r in records],
            "top_logprobs": [{a["token"]: a["logprob"] for a in r["top"]} for r in records],
            "text_offset": [r["offset"] for r in records]}


class Logprobs:
    """The logprobs of a response's tokens as they stream (Piece.logprob/top), formatted by `fmt` (chat's or the
    legacy form, above) for each chunk that carries them or for the whole answer."""

    def __init__(self, target, fmt) -> None:
        self.target, self.fmt = target, fmt
        self.pending: list[dict] = []
        self.offset = 0  # characters of token text so far (the legacy text_offset)

    def _one(self, token: int, logprob: float) -> dict:
        b = self.target.piece(token)
        return {"token": b.decode("utf-8", "replace"), "bytes": list(b), "logprob": logprob}

    def add(self, ev) -> None:  # a core.generation Piece
        if ev.logprob is None:
            return
        r = self._one(ev.token, ev.logprob)
        r["top"] = [self._one(t, lp) for t, lp in ev.top or ()]
        r["offset"] = self.offset
        self.offset += len(r["token"])
        self.pending.append(r)

    def take(self) -> dict:
        out, self.pending = self.fmt(self.pending), []
        return out
