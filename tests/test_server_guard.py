"""The guard in front of `localspec serve` (server/guard.py) that keeps a web page the user visits off the local
API: a body not declared JSON is a 415, a foreign Host header (DNS rebinding) a 403, and only allowed origins get
CORS answers; `--cors-origins localhost` lets in pages served from this machine on any port, and an entry that names
no origin is refused at start instead of silently matching nothing."""

from __future__ import annotations

import http.client
import json

import pytest

from helpers import KEY, post, serving

UI = "http://ui.example:5173"  # a web UI the tests let in
LOCAL = ["http://localhost:5173", "http://127.0.0.1:3000", "http://[::1]:8080", "https://localhost",
         "http://LocalHost:1"]
FOREIGN = ["http://localhost.attacker.example", "http://attacker.example:5173", "http://127.0.0.1.nip.io:80",
           "null", "file://"]


@pytest.fixture(scope="module")
def ui_api(session):
    """An API key and one allowed web UI origin."""
    from localspec.server.config import ServerConfig

    with serving(session, ServerConfig(api_key=KEY, cors_origins=(UI,))) as s:
        yield s


@pytest.fixture(scope="module")
def local_ui(session):
    from localspec.server.config import ServerConfig

    with serving(session, ServerConfig(cors_origins="localhost")) as s:
        yield s


# ----------------------------------------------------------------- Content-Type, Host, Origin, CORS
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


# ----------------------------------------------------------------- --cors-origins localhost
@pytest.mark.parametrize("origin", LOCAL)
def test_localhost_lets_in_pages_on_this_machine_on_any_port(local_ui, origin):
    status, headers, _ = local_ui.raw("OPTIONS", "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    assert status == 200 and {k.lower(): v for k, v in headers.items()}["access-control-allow-origin"] == origin
    status, headers, data = post(local_ui, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, Origin=origin)
    assert status == 200, data
    assert {k.lower(): v for k, v in headers.items()}["access-control-allow-origin"] == origin


@pytest.mark.parametrize("origin", FOREIGN)
def test_localhost_keeps_other_pages_out(local_ui, origin):
    status, headers, data = post(local_ui, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, Origin=origin)
    assert status == 403 and data["error"]["code"] == "origin_not_allowed", data
    assert "access-control-allow-origin" not in {k.lower() for k in headers}


@pytest.mark.parametrize("value", ["example.com", "localhost:5173", "http://", "ui.example,http://ok.example"])
def test_an_entry_that_is_no_origin_is_refused_in_one_line(value):
    from localspec.errors import UsageError
    from localspec.server.config import ServerConfig

    with pytest.raises(UsageError) as e:
        ServerConfig(cors_origins=value).check()
    msg = str(e.value)
    assert "--cors-origins" in msg and "\n" not in msg and "localhost" in msg
    for ok in ("*", "localhost", "http://ui.example:5173", "https://x.example, localhost"):
        ServerConfig(cors_origins=ok).check()


def test_the_command_refuses_it_before_loading_anything(tmp_path, capsys):
    from localspec.cli.app import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "-m", str(tmp_path / "absent.gguf"), "--cors-origins", "example.com"])
    err = capsys.readouterr().err
    assert e.value.code != 0 and err.startswith("error: --cors-origins") and err.count("\n") == 1, err
