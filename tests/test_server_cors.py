"""`--cors-origins localhost` (llama-server's keyword): web pages served from this machine, on any port, may call
the API; an entry that names no origin is refused at start instead of silently matching nothing."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from test_server_hardening import post, serving, session  # noqa: E402,F401  (fixtures)

LOCAL = ["http://localhost:5173", "http://127.0.0.1:3000", "http://[::1]:8080", "https://localhost",
         "http://LocalHost:1"]
FOREIGN = ["http://localhost.attacker.example", "http://attacker.example:5173", "http://127.0.0.1.nip.io:80",
           "null", "file://"]


@pytest.fixture(scope="module")
def local_ui(session):
    from localspec.server.config import ServerConfig

    with serving(session, ServerConfig(cors_origins="localhost")) as s:
        yield s


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
