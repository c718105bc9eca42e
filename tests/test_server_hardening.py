"""`localspec serve` against hostile input and web pages: bad text, stalling k, bad start-up settings, signals
mid-stream, and the Host / Origin / Content-Type checks that keep a web page the user visits off the local API."""

from __future__ import annotations

import http.client
import json
import re
import signal
from contextlib import contextmanager

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from test_server import CTX, LONG, PROMPT, Served, _env, _start, cli, running  # noqa: E402

KEY = "k3y"
UI = "http://ui.example:5173"  # a web UI the tests let in


@contextmanager
def serving(session, config):
    from localspec.server.app import create_app

    app = create_app(session, config, log=lambda m: None)
    try:
        with running(app) as url:
            yield Served(url, app, session, None)
    finally:
        assert app.state.worker.stop(timeout=30)


@pytest.fixture(scope="module")
def session(target_path, draft_path, tmp_path_factory):
    from localspec.session import Session

    with pytest.MonkeyPatch.context() as mp:
        for k in list(__import__("os").environ):
            if k.startswith("LOCALSPEC_") and k not in ("LOCALSPEC_CACHE_DIR", "LOCALSPEC_TEST_MODELS"):
                mp.delenv(k)
        mp.setenv("LOCALSPEC_CONFIG_DIR", str(tmp_path_factory.mktemp("cfg")))
        sess = Session({"model": str(target_path), "draft": str(draft_path), "method": "draft", "draft_tokens": 3,
                        "ctx_size": CTX}, quiet=True)
        sess.load()
        yield sess
        sess.close()


@pytest.fixture(scope="module")
def open_api(session):
    """The default configuration: loopback, no key, no web origins."""
    from localspec.server.config import ServerConfig

    with serving(session, ServerConfig(queue_size=2)) as s:
        yield s


@pytest.fixture(scope="module")
def ui_api(session):
    """An API key and one allowed web UI origin."""
    from localspec.server.config import ServerConfig

    with serving(session, ServerConfig(api_key=KEY, cors_origins=(UI,))) as s:
        yield s


def post(s, path, body, **headers):
    return s.raw("POST", path, body if isinstance(body, (bytes, str)) else json.dumps(body), headers)


# ----------------------------------------------------------------- item 7: a lone surrogate is a 400, not a 500
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


# ----------------------------------------------------------------- item 6: k is bounded per server
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


# ----------------------------------------------------------------- errors speak the API
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


# ----------------------------------------------------------------- web pages: Content-Type, Host, Origin, CORS
@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None])
def test_a_body_that_is_not_declared_json_is_415(open_api, ctype):
    headers = {"Content-Type": ctype} if ctype else {}
    conn = http.client.HTTPConnection(open_api.host, int(open_api.port), timeout=60)
    conn.putrequest("POST", "/v1/completions", skip_accept_encoding=True)
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    for k, v in {**headers, "Content-Length": str(len(body))}.items():
        conn.putheader(k, v)
    conn.endheaders(body)
    r = conn.getresponse()
    data = json.loads(r.read())
    conn.close()
    assert r.status == 415 and data["error"]["code"] == "unsupported_media_type", data
    status, _, data = post(open_api, "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                           **{"Content-Type": "application/json; charset=utf-8"})
    assert status == 200, data


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:{port}", "127.0.0.1.attacker.example"])
def test_a_foreign_host_header_is_403(open_api, host):
    """DNS rebinding: a page at attacker.example whose name now resolves to 127.0.0.1 sends its own name."""
    status, _, data = post(open_api, "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                           Host=host.format(port=open_api.port))
    assert status == 403 and data["error"]["code"] == "host_not_allowed", data
    status, _, data = open_api.raw("GET", "/v1/models", headers={"Host": host.format(port=open_api.port)})
    assert status == 403


@pytest.mark.parametrize("host", ["localhost", "localhost:{port}", "127.0.0.1:{port}", "[::1]:{port}", "LOCALHOST"])
def test_loopback_host_headers_are_accepted(open_api, host):
    status, _, data = open_api.raw("GET", "/v1/models", headers={"Host": host.format(port=open_api.port)})
    assert status == 200, data


def test_a_cross_origin_request_is_403_by_default(open_api):
    status, headers, data = post(open_api, "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                                 Origin="http://attacker.example")
    assert status == 403 and data["error"]["code"] == "origin_not_allowed", data
    assert "access-control-allow-origin" not in {k.lower() for k in headers}
    status, _, _ = open_api.raw("OPTIONS", "/v1/completions", headers={
        "Origin": "http://attacker.example", "Access-Control-Request-Method": "POST"})
    assert status == 403


def test_an_allowed_origin_gets_its_preflight_without_the_key_and_cors_headers(ui_api):
    status, headers, _ = ui_api.raw("OPTIONS", "/v1/chat/completions", headers={
        "Origin": UI, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    h = {k.lower(): v for k, v in headers.items()}
    assert status == 200 and h["access-control-allow-origin"] == UI
    assert "POST" in h["access-control-allow-methods"]
    assert "authorization" in h["access-control-allow-headers"].lower()
    status, headers, data = post(ui_api, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, Origin=UI,
                                 Authorization=f"Bearer {KEY}")
    assert status == 200 and {k.lower(): v for k, v in headers.items()}["access-control-allow-origin"] == UI, data
    status, headers, data = post(ui_api, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, Origin=UI)
    assert status == 401  # the key is still needed for the request itself; the browser may read the error
    assert {k.lower(): v for k, v in headers.items()}["access-control-allow-origin"] == UI
    status, _, data = post(ui_api, "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                           Origin="http://attacker.example", Authorization=f"Bearer {KEY}")
    assert status == 403 and data["error"]["code"] == "origin_not_allowed"


def test_host_check_rules(monkeypatch):
    from localspec.server.config import ServerConfig
    from localspec.server.guard import HostCheck

    loop = HostCheck("127.0.0.1")
    assert all(loop(h) for h in ("127.0.0.1:80", "localhost", "[::1]:8080", None))
    assert not any(loop(h) for h in ("attacker.example", "10.0.0.1", "localhost.attacker.example", "[::2]"))
    assert HostCheck("::1")("[::1]:9")
    named = HostCheck("127.0.0.1", ("my-box.lan",))
    assert named("My-Box.lan:8080") and not named("other.lan")
    assert HostCheck("127.0.0.1", ("*",))("anything.example")
    wide = HostCheck("0.0.0.0")  # reachable from the network: clients name it by an address
    assert wide("192.168.1.5:8080") and wide("[fe80::1]:8080") and not wide("attacker.example")
    monkeypatch.setenv("LOCALSPEC_ALLOWED_HOSTS", " box.example , ui.example ")
    assert ServerConfig().resolved(3).allowed_hosts == ("box.example", "ui.example")
    assert ServerConfig(allowed_hosts="a,b").resolved(3).allowed_hosts == ("a", "b")
    assert ServerConfig().resolved(0).max_k == 1


# ----------------------------------------------------------------- item 9 and item 8: the command
def test_a_bad_parallel_setting_is_refused_at_start_up(target_path, tmp_path):
    env = _env(tmp_path / "cfg")
    env["LOCALSPEC_PARALLEL"] = "-1"
    r = cli(["serve", "-m", str(target_path), "--port", "0", "--method", "none"], env, timeout=60)
    err = r.stderr.decode()
    assert r.returncode == 2 and err.startswith("error: ") and "LOCALSPEC_PARALLEL" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_stream_ends_it_with_an_error_event_and_done(target_path, tmp_path, sig):
    p, url, _ = _start(["-m", str(target_path), "--port", "0", "--method", "none", "-c", str(CTX)],
                       _env(tmp_path / "cfg"))
    try:
        host, port = url.split("//")[1].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPT, "max_tokens": LONG, "stream": True}),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        assert r.read(6) == b"data: "  # the stream has begun
        p.send_signal(sig)
        rest = r.read().decode()  # ends when the server closes the stream
        conn.close()
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    events = [e for e in rest.split("\n\n") if e]
    assert events[-1] == "data: [DONE]", events[-3:]
    last = json.loads(events[-2][len("data: "):])
    assert last["error"]["code"] == "shutting_down", last
    err = err.decode()
    assert p.returncode == 0 and "localspec serve: stopped" in err, err
    assert "Traceback" not in err and "CancelledError" not in err, err


def test_serve_takes_the_server_settings_as_keywords():
    """The CLI calls serve(session, host=, port=, api_key=, queue_size=); the new settings are optional keywords,
    checked before anything is bound or loaded."""
    from localspec.errors import UsageError
    from localspec.server.app import serve

    with pytest.raises(UsageError, match="max k"):
        serve(object(), port=0, max_k=0)
    with pytest.raises(UsageError, match="--queue"):
        serve(object(), port=0, queue_size=0, cors_origins="http://ui.example", allowed_hosts="*", strict_model=True)
