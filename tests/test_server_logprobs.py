"""logprobs / top_logprobs and logit_bias through `localspec serve` (chat and legacy completions): the logprobs of
plain decoding with every method, whole and streamed; a banned token never appears and speculation keeps plain
output; a bias that leaves no token to emit is a 400 naming logit_bias, never a banned token, a NaN logprob or a
500. (The engine and the batch: test_logprobs.py.)"""

from __future__ import annotations

import json
import math

import pytest

from helpers import LOGPROB_TOL as TOL, post


# ----------------------------------------------------------------- through the server (chat and legacy)
MSG = [{"role": "user", "content": "the cat and the dog"}]


def chat(c, method="draft", **kw):
    return c.chat.completions.create(model="x", messages=MSG, max_tokens=12, temperature=0,
                                     extra_body={"localspec": {"method": method}}, **kw)


def test_chat_logprobs_whole_and_streamed(open_api):
    c = open_api.client(max_retries=0)
    plain = chat(c, "none", logprobs=True, top_logprobs=3).choices[0]
    got = chat(c, "draft", logprobs=True, top_logprobs=3).choices[0]
    assert got.message.content == plain.message.content
    a, b = got.logprobs.content, plain.logprobs.content
    assert len(a) == len(b) == 12
    for x, y in zip(a, b):
        assert x.token == y.token and bytes(x.bytes).decode("utf-8", "replace") == x.token
        assert x.logprob == pytest.approx(y.logprob, abs=TOL) and len(x.top_logprobs) == 3
        assert x.top_logprobs[0].token == x.token and x.top_logprobs[0].logprob == x.logprob
    streamed = []
    for ch in chat(c, "draft", logprobs=True, top_logprobs=3, stream=True):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += ch.choices[0].logprobs.content
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in a]
    assert chat(c).choices[0].logprobs is None  # not asked: none
    assert chat(c, logprobs=True).choices[0].logprobs.content[0].top_logprobs == []


def test_legacy_completion_logprobs(open_api):
    c = open_api.client(max_retries=0)
    r = c.completions.create(model="x", prompt="the cat and the dog", max_tokens=10, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    for tok, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert x <= 0 and 1 <= len(top) <= 2 and all(v <= 0 for v in top.values())
        if len(top) == 2:  # (keys are token texts: byte tokens that decode alike share one, as in OpenAI's form)
            assert max(top.values()) == pytest.approx(x)
    streamed = []
    for ch in c.completions.create(model="x", prompt="the cat and the dog", max_tokens=10, temperature=0,
                                   logprobs=2, stream=True):
        if ch.choices[0].logprobs is not None:
            streamed += ch.choices[0].logprobs.token_logprobs
    assert streamed == lp.token_logprobs


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/chat/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": "x"}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": [1, 2]}, "logit_bias"),
])
def test_bad_logprobs_and_logit_bias_are_400s(open_api, path, body, param):
    base = {"messages": MSG} if "chat" in path else {"prompt": "hi"}
    status, _, err = post(open_api, path, {**base, "max_tokens": 2, **body})
    assert status == 400 and err["error"]["param"] == param, err


def test_logit_bias_bans_a_token_and_speculation_keeps_plain_output(open_api):
    c = open_api.client(max_retries=0)
    target = open_api.session.engine.target
    ids: dict[bytes, list[int]] = {}
    for t in range(target.n_vocab):
        ids.setdefault(target.piece(t), []).append(t)
    plain = chat(c, "none", logprobs=True).choices[0].logprobs.content
    tok = next(x for x in plain[1:] if len(ids[bytes(x.bytes)]) == 1)  # a token plain decoding emits
    ban = {str(ids[bytes(tok.bytes)][0]): -100}
    outs = {m: chat(c, m, logprobs=True, logit_bias=ban).choices[0] for m in ("none", "lookup", "draft")}
    assert all(bytes(x.bytes) != bytes(tok.bytes) for x in outs["none"].logprobs.content)
    assert outs["none"].message.content != chat(c, "none").choices[0].message.content
    assert outs["none"].message.content == outs["lookup"].message.content == outs["draft"].message.content


def _strict(text: str):
    """JSON as a strict parser reads it: NaN and Infinity are not JSON."""
    def bad(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=bad)


def _sse(body: str) -> list:
    return [_strict(line[len("data: "):]) for line in body.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("temperature", [0, 1])
@pytest.mark.parametrize("stream", [False, True])
def test_a_bias_banning_every_token_is_a_400_naming_logit_bias(open_api, temperature, stream):
    n_vocab = open_api.session.engine.target.n_vocab
    ban = {str(t): -100 for t in range(n_vocab)}
    status, _, body = post(open_api, "/v1/chat/completions", {
        "messages": MSG, "max_tokens": 8, "temperature": temperature, "logit_bias": ban, "logprobs": True,
        "top_logprobs": 2, "stream": stream})
    assert status == 400, body
    assert body["error"]["param"] == "logit_bias" and "logit_bias" in body["error"]["message"], body


@pytest.mark.parametrize("temperature", [0, 0.7])
@pytest.mark.parametrize("stream", [False, True])
def test_json_object_with_every_brace_token_banned_is_a_400_naming_logit_bias(open_api, temperature, stream):
    target = open_api.session.engine.target
    ban = {str(t): -100 for t in range(target.n_vocab) if target.piece(t).lstrip().startswith(b"{")}
    assert ban
    status, _, body = post(open_api, "/v1/chat/completions", {
        "messages": MSG, "max_tokens": 8, "temperature": temperature, "logit_bias": ban, "seed": 3,
        "response_format": {"type": "json_object"}, "logprobs": True, "stream": stream})
    if status == 200:  # streamed past a first token the grammar allows (white space): the error ends the stream
        events = _sse(body)
        assert events[-1]["error"]["param"] == "logit_bias", events[-1]
    else:
        assert status == 400 and body["error"]["param"] == "logit_bias", body


def test_streamed_logprobs_under_a_bias_are_json(open_api):
    """Every event of a streamed answer under a ban is strict JSON, with finite logprobs."""
    target = open_api.session.engine.target
    ban = {str(t): -100 for t in range(0, target.n_vocab, 2)}
    for temperature in (0, 1):
        status, _, body = post(open_api, "/v1/chat/completions", {
            "messages": MSG, "max_tokens": 8, "temperature": temperature, "logit_bias": ban, "seed": 2,
            "logprobs": True, "top_logprobs": 3, "stream": True})
        assert status == 200
        entries = [e for ev in _sse(body) for c in ev["choices"] if c.get("logprobs")
                   for e in c["logprobs"]["content"]]
        assert entries and all(math.isfinite(e["logprob"]) for e in entries)
