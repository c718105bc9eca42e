"""`localspec serve` as the official `openai` client sees it: model names and GET /v1/models/{id}, strict_model,
OpenAI's range checks, x-request-id."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from test_server_hardening import open_api, serving, session  # noqa: E402,F401  (fixtures)


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
