"""`localspec serve` as the official `openai` client sees it: model names and GET /v1/models/{id}, strict_model,
OpenAI's range checks, x-request-id; a bad request is a 400 naming its JSON field (never a CLI flag), before any
work is queued."""

from __future__ import annotations

import re

import openai
import pytest

from helpers import PROMPT, post, serving


def test_models_retrieve_any_name_answers_the_served_id(open_api):
    c = open_api.client(max_retries=0)
    name = open_api.app.state.model
    for asked in (name, "localspec", "gpt-4o-mini", "org/some-model"):
        m = c.models.retrieve(asked)
        assert m.id == name, asked
    r = c.completions.create(model="davinci-002", prompt="hi", max_tokens=2)
    assert r.model == name


def test_strict_model_refuses_other_names_with_404(session):
    from localspec.server.config import ServerConfig

    with serving(session, ServerConfig(strict_model=True)) as s:
        c = s.client(max_retries=0)
        name = s.app.state.model
        with pytest.raises(openai.NotFoundError) as e:
            c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        err = e.value.body if isinstance(e.value.body, dict) and "message" in e.value.body else e.value.body["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-4o" in err["message"]
        with pytest.raises(openai.NotFoundError):
            c.models.retrieve("gpt-4o")
        assert c.models.retrieve(name).id == name
        assert c.completions.create(model="localspec", prompt="hi", max_tokens=2).model == name


@pytest.mark.parametrize("kw,param", [
    ({"temperature": 2.5}, "temperature"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"n": 9}, "n"),
    ({"n": 0}, "n"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
])
def test_openai_range_checks_are_400(open_api, kw, param):
    c = open_api.client(max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="localspec", prompt="hi", max_tokens=2, **kw)
    assert e.value.body["param"] == param if "param" in e.value.body else e.value.body["error"]["param"] == param
    ok = {"temperature": 2, "presence_penalty": -2, "frequency_penalty": 2}
    assert c.completions.create(model="localspec", prompt="hi", max_tokens=2, seed=1, **ok).usage.completion_tokens == 2


def test_every_response_has_an_x_request_id(open_api):
    c = open_api.client(max_retries=0)
    raw = c.completions.with_raw_response.create(model="localspec", prompt="hi", max_tokens=2)
    ids = {raw.headers["x-request-id"]}
    for method, path, body, headers in (("GET", "/health", None, {}), ("GET", "/nope", None, {}),
                                        ("POST", "/v1/completions", b"{", {}),
                                        ("GET", "/v1/models", None, {"Host": "attacker.example"}),
                                        ("POST", "/v1/completions", b"{}", {"Content-Type": "text/plain"})):
        status, h, _ = open_api.raw(method, path, body, headers)
        ids.add({k.lower(): v for k, v in h.items()}["x-request-id"])
    assert len(ids) == 6 and all(i.startswith("req_") for i in ids)
    _, h, _ = open_api.raw("GET", "/health", headers={"X-Request-Id": "trace-42"})
    assert {k.lower(): v for k, v in h.items()}["x-request-id"] == "trace-42"
    _, h, _ = open_api.raw("GET", "/health", headers={"X-Request-Id": "bad id\twith spaces"})
    assert {k.lower(): v for k, v in h.items()}["x-request-id"].startswith("req_")


# ----------------------------------------------------------------- bad requests name their JSON field
@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}', "messages"),
    ("/v1/completions", b'{"prompt": "hi \\udfff there", "max_tokens": 2}', "prompt"),
])
def test_a_lone_surrogate_is_400(open_api, path, body, param):
    before = open_api.health()["generations"]
    status, _, data = post(open_api, path, body)
    assert status == 400, data
    assert data["error"]["param"] == param and "surrogate" in data["error"]["message"]
    assert open_api.health()["generations"] == before  # refused before it reached the worker
    assert open_api.client().completions.create(model="localspec", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_a_k_above_max_k_is_400_before_any_work(open_api):
    assert open_api.app.state.config.max_k == 3  # the session's draft_tokens
    status, _, data = post(open_api, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4,
                                                          "localspec": {"method": "lookup", "k": 64, "exactness": "bit"}})
    assert status == 400 and data["error"]["param"] == "localspec.k", data
    assert "3" in data["error"]["message"] and "64" in data["error"]["message"]
    r = open_api.client().completions.create(model="localspec", prompt=PROMPT, max_tokens=4,
                                             extra_body={"localspec": {"method": "lookup", "k": 3}})
    assert r.model_extra["localspec"]["requested_k"] == 3


def test_max_k_is_configurable(session):
    from localspec.server.config import ServerConfig

    with serving(session, ServerConfig(max_k=5)) as s:
        status, _, data = post(s, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "localspec": {"k": 5}})
        assert status == 200, data
        status, _, data = post(s, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "localspec": {"k": 6}})
        assert status == 400 and data["error"]["param"] == "localspec.k"


FLAG = re.compile(r"(?<![\w-])--?[a-zA-Z]")  # -k, -c, --method ...


@pytest.mark.parametrize("extra,param", [
    ({"localspec": {"k": -1}}, "localspec.k"),
    ({"localspec": {"k": 65}}, "localspec.k"),
    ({"localspec": {"method": "magic"}}, "localspec.method"),
    ({"localspec": {"exactness": "exact"}}, "localspec.exactness"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": -1}, "seed"),
])
def test_bad_values_name_json_fields_never_cli_flags(open_api, extra, param):
    status, _, data = post(open_api, "/v1/completions", {"prompt": "hi", **extra})
    assert status == 400, data
    err = data["error"]
    assert err["param"] == param, err
    assert not FLAG.search(err["message"]), err["message"]
    assert "{" not in err["message"]  # every setting placeholder worded


def test_method_draft_without_a_draft_names_the_field(target_path, tmp_path):
    from localspec.server.config import ServerConfig
    from localspec.session import Session

    sess = Session({"model": str(target_path), "method": "none"}, quiet=True)
    try:
        with serving(sess, ServerConfig()) as s:
            status, _, data = post(s, "/v1/completions", {"prompt": "hi", "localspec": {"method": "draft"}})
            assert status == 400 and data["error"]["param"] == "localspec.method", data
            assert "draft model" in data["error"]["message"] and not FLAG.search(data["error"]["message"])
    finally:
        sess.close()
