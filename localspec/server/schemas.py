"""Request bodies (pydantic) and their checks beyond types: messages, prompt, stop strings. Every problem is an
APIError 400 naming the JSON field."""

from __future__ import annotations

import json
from typing import Any, Optional

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError

from localspec.server.config import MAX_STOPS
from localspec.server.openai import MAX_DEPTH, APIError, invalid, too_deep
from localspec.server.tool_template import template_tool_calls


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


class Common(_Body):
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
    presence_penalty: Optional[float] = None  # range-checked as OpenAI does; not applied
    frequency_penalty: Optional[float] = None
    response_format: Any = None  # structured output: server/grammar.py
    logit_bias: Any = None  # {token id as a string: -100..100}: logit_bias_of


class ChatMessage(_Body):
    role: str
    content: Any = None  # str, a list of text parts, or null (an assistant turn with tool calls)
    tool_calls: Any = None  # an assistant turn's calls (server/tool_template.py checks them)
    tool_call_id: Optional[str] = None  # a tool result's call


class ChatRequest(Common):
    messages: list[ChatMessage]
    tools: Any = None  # checked by server/tool_template.py
    tool_choice: Any = None
    parallel_tool_calls: Optional[bool] = None  # false: a forced call (tool_choice required) is one call
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None


class CompletionRequest(Common):
    prompt: Any  # str or a list of one str
    logprobs: Optional[int] = None  # the legacy form: the number of alternatives (0..5)


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def chat_messages(req: ChatRequest) -> list[dict]:
    if not req.messages:
        raise APIError(400, "messages must hold at least one message", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        role = ROLES.get(m.role)
        if role is None:
            raise APIError(400, f"messages[{i}].role {m.role!r} is not supported; use system, user, assistant or tool",
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
        msg: dict[str, Any] = {"role": role, "content": text}
        if m.tool_calls is not None and role == "assistant":
            msg["tool_calls"] = template_tool_calls(m.tool_calls, f"messages[{i}].tool_calls")
        if role == "tool":
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if isinstance(getattr(m, "name", None), str):
                msg["name"] = m.name
        out.append(msg)
    return out


MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI
MAX_LEGACY_LOGPROBS = 5  # /v1/completions' logprobs, as OpenAI


def logprobs_of(req) -> int | None:
    """GenConfig.logprobs of a request: None (none asked for) or how many alternatives per token. Chat:
    `logprobs: true` with `top_logprobs` 0..20; legacy completions: `logprobs` 0..5."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        n = req.top_logprobs or 0
        if not 0 <= n <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {n}",
                           param="top_logprobs")
        return n if req.logprobs else None
    if isinstance(req, CompletionRequest) and req.logprobs is not None:
        if not 0 <= req.logprobs <= MAX_LEGACY_LOGPROBS:
            raise APIError(400, f"logprobs must be between 0 and {MAX_LEGACY_LOGPROBS}, got {req.logprobs}",
                           param="logprobs")
        return req.logprobs
    return None


def logit_bias_of(value: Any, n_vocab: int) -> dict[int, float] | None:
    """GenConfig.logit_bias of a request's `logit_bias` ({"token id": bias}; ids of the served target's
    vocabulary, biases -100..100, -100 a ban). 400 naming the bad key or value."""
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise APIError(400, "logit_bias must be an object mapping token ids to biases", param="logit_bias")
    out = {}
    for key, bias in value.items():
        try:
            t = int(key)
        except (TypeError, ValueError):
            t = -1
        if not (isinstance(key, str) and key.strip().lstrip("-").isdigit()) or not 0 <= t < n_vocab:
            raise APIError(400, f"logit_bias: {key!r} is not a token id of this model (0 to {n_vocab - 1})",
                           param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise APIError(400, f"logit_bias[{key!r}] must be a number between -100 and 100, got {bias!r}",
                           param="logit_bias")
        out[t] = float(bias)
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


def _surrogate_at(obj, where: str = "") -> str | None:
    """The place (a JSON path) of the first string holding a lone surrogate (valid JSON, not valid Unicode)."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return where or "body"
        return None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        if isinstance(key, str) and _surrogate_at(key) is not None:
            return where or "body"
        sub = f"{where}[{key}]" if isinstance(key, int) else (f"{where}.{key}" if where else str(key))
        found = _surrogate_at(value, sub)
        if found is not None:
            return found
    return None


async def parse_body(request: Request, model: type[BaseModel]):
    """The JSON body as `model` (the guard has checked the Content-Type and the size)."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    for key, value in data.items():  # before any walk over it (the body itself is the first level)
        if too_deep(value, MAX_DEPTH - 1):
            raise APIError(400, f"{key} is nested more than {MAX_DEPTH} levels deep", param=key)
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:  # "\ud800": JSON allows the escape, but it is no character; found before any work
        try:
            where = _surrogate_at(data) or "body"
        except RecursionError:
            where = "body"
        raise APIError(400, f"{where}: a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not valid "
                            "Unicode text", param=where.split(".")[0].split("[")[0], code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the body is nested too deeply", code="invalid_json") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid(exc.errors()) from None
