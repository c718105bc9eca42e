"""`localspec serve`: the OpenAI-compatible API, driven by the official `openai` client against a server on a free
local port with the tiny test models (in-process on a uvicorn thread; the CLI command as a real subprocess)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading
import time

import openai
import pytest

from helpers import CTX, LONG, PROMPT, Served, clean_env, cli, running, server_env, start_serve

N = 24
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def served(target_path, draft_path, tmp_path_factory):
    from localspec.server.app import create_app
    from localspec.session import Session

    cfg_dir = tmp_path_factory.mktemp("cfg")
    with pytest.MonkeyPatch.context() as mp:
        clean_env(mp, cfg_dir)
        sess = Session({"model": str(target_path), "draft": str(draft_path), "method": "draft", "draft_tokens": 3,
                        "ctx_size": CTX}, quiet=True)
        sess.load()
        app = create_app(sess, queue_size=1, max_body=MAX_BODY, log=lambda m: None)
        try:
            with running(app) as url:
                yield Served(url, app, sess, server_env(cfg_dir))
        finally:
            if app.state.worker.stop(timeout=30):  # never free the models under a running generation
                sess.close()


@pytest.fixture(scope="module")
def plain(served, target_path):
    """What `localspec run` answers (plain decoding, no draft) for PROMPT: (chat text, raw text)."""
    base = ["run", "-m", str(target_path), "--method", "none", "-n", str(N), "--json"]
    chat = cli(base + [PROMPT], served.env)
    raw = cli(base + ["--raw", PROMPT], served.env)
    assert chat.returncode == 0 and raw.returncode == 0, (chat.stderr, raw.stderr)
    return json.loads(chat.stdout)["text"], json.loads(raw.stdout)["text"]


def check_stats(ls: dict, usage: dict | None = None) -> None:
    for key in ("tokens_per_second", "acceptance_rate", "tokens_per_pass", "mean_accepted_length", "method", "k",
                "drafted", "accepted"):
        assert key in ls, key
    assert ls["requested_method"] == "draft" and 1 <= ls["k"] <= 3
    assert ls["drafted"] > 0 and 0 <= ls["accepted"] <= ls["drafted"]
    assert ls["acceptance_rate"] == pytest.approx(ls["accepted"] / ls["drafted"])
    assert ls["tokens_per_pass"] >= 1.0
    if usage is not None:
        assert usage["completion_tokens"] == N and usage["prompt_tokens"] > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + N


# ----------------------------------------------------------------- answers equal `localspec run`
def test_chat_equals_run_streamed_and_not(served, plain):
    c = served.client()
    r = c.chat.completions.create(model=served.app.state.model, messages=[{"role": "user", "content": PROMPT}],
                                  max_tokens=N, temperature=0)
    d = r.model_dump()
    assert d["choices"][0]["message"]["content"] == plain[0]
    assert d["choices"][0]["finish_reason"] == "length" and d["object"] == "chat.completion"
    check_stats(d["localspec"], d["usage"])

    chunks = [ch.model_dump() for ch in c.chat.completions.create(
        model="localspec", messages=[{"role": "user", "content": PROMPT}], max_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True})]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    assert text == plain[0]
    final = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] == "length"
    check_stats(final[0]["localspec"])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == N  # the usage chunk
    check_stats(chunks[-1]["localspec"], chunks[-1]["usage"])


def test_completion_equals_run_raw_streamed_and_not(served, plain):
    c = served.client()
    r = c.completions.create(model=served.app.state.model, prompt=PROMPT, max_tokens=N, temperature=0).model_dump()
    assert r["choices"][0]["text"] == plain[1] and r["object"] == "text_completion"
    check_stats(r["localspec"], r["usage"])
    r1 = c.completions.create(model="localspec", prompt=[PROMPT], max_tokens=N, temperature=0).model_dump()
    assert r1["choices"][0]["text"] == plain[1]  # a list of one string

    chunks = [ch.model_dump() for ch in c.completions.create(model="localspec", prompt=PROMPT, max_tokens=N,
                                                              temperature=0, stream=True)]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == plain[1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    check_stats(chunks[-1]["localspec"])
    assert all(ch.get("usage") is None for ch in chunks)  # no usage chunk unless asked for


def test_stream_ends_with_done(served):
    conn = http.client.HTTPConnection(served.host, int(served.port), timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPT, "max_tokens": 3, "stream": True}),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    body = r.read().decode()
    conn.close()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_stop_and_seed(served, plain):
    c = served.client()
    stop = plain[1][3:6]
    r = c.completions.create(model="localspec", prompt=PROMPT, max_tokens=N, temperature=0, stop=[stop]).model_dump()
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["text"] == plain[1][: plain[1].index(stop)]
    a, b = (c.completions.create(model="localspec", prompt=PROMPT, max_tokens=N, temperature=0.9, top_p=0.9,
                                 seed=7).choices[0].text for _ in range(2))
    assert a == b  # the same seed samples the same answer


def test_extending_a_conversation_reuses_the_cache(served):
    c = served.client()
    first = [{"role": "user", "content": "the dog"}]
    r1 = c.chat.completions.create(model="localspec", messages=first, max_tokens=8, temperature=0)
    msgs = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                    {"role": "user", "content": "and the cat"}]
    r2 = c.chat.completions.create(model="localspec", messages=msgs, max_tokens=8, temperature=0).model_dump()
    cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= r1.usage.prompt_tokens  # the whole first prompt came from the cache
    assert cached < r2["usage"]["prompt_tokens"]


# ----------------------------------------------------------------- models, health, errors
def test_models_and_health(served, target_path):
    ms = served.client().models.list().data
    assert [m.id for m in ms] == [target_path.name] == [served.app.state.model]
    h = served.health()
    assert h["status"] == "ok" and h["model"] == target_path.name and "cancelled" in h["generations"]


def test_any_model_name_is_served_and_n_past_its_bound_is_400(served):
    """Clients come preconfigured with names like gpt-4o: the one loaded pair answers (as llama-server does), under
    its own id. (ServerConfig.strict_model restores the refusal, as a 404: test_server_openai.py.)"""
    c = served.client(max_retries=0)
    r = c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.model == served.app.state.model and r.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="localspec", prompt="hi", max_tokens=2, n=9)
    assert "n must be between 1 and 8" in str(e.value)


@pytest.mark.parametrize("body,needle", [
    (b'{"prompt": "x",', "malformed JSON"),
    (b"\xff\xfe", "malformed JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"max_tokens": 3}', "prompt"),
    (b'{"prompt": "x", "max_tokens": "many"}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 0}', "max tokens"),
    (b'{"prompt": "x", "temperature": -1}', "temperature"),
    (b'{"prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"prompt": "x", "top_p": 1.5}', "top-p"),
    (b'{"prompt": "x", "seed": -1}', "seed"),
    (b'{"prompt": "x", "stop": [1]}', "stop"),
    (b'{"prompt": ["a", "b"]}', "list of one string"),
    (b'{"prompt": ""}', "empty"),
])
def test_malformed_completion_bodies_are_400(served, body, needle):
    status, _, data = served.raw("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    assert status == 400, data
    assert set(data["error"]) == {"message", "type", "param", "code"} and needle in data["error"]["message"]
    assert "Traceback" not in json.dumps(data)


@pytest.mark.parametrize("messages,needle", [
    ([], "at least one"),
    ([{"role": "robot", "content": "x"}], "role"),  # (role "tool" is a tool result)
    ([{"content": "x"}], "role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "text parts"),
    ([{"role": "user", "content": 5}], "content"),
    ("hello", "messages"),
])
def test_malformed_chat_bodies_are_400_and_the_server_keeps_serving(served, messages, needle):
    status, _, data = served.raw("POST", "/v1/chat/completions", json.dumps({"messages": messages}))
    assert status == 400 and needle in data["error"]["message"], data
    r = served.client().chat.completions.create(model="localspec", max_tokens=2, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert r.usage.completion_tokens == 2


def test_body_too_large_is_413(served):
    status, _, data = served.raw("POST", "/v1/completions", json.dumps({"prompt": "x" * (MAX_BODY + 1)}))
    assert status == 413 and data["error"]["code"] == "request_too_large", data
    status, _, data = served.raw("GET", "/nope")
    assert status == 404 and "error" in data
    assert served.client().completions.create(model="localspec", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_a_crashing_generation_is_500_and_the_worker_survives(served, monkeypatch):
    from localspec.core.batch import BatchEngine

    def boom(*a, **k):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(BatchEngine, "step", boom)
    status, _, data = served.raw("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}))
    assert status == 500 and data["error"]["message"] == "internal error: RuntimeError"
    monkeypatch.undo()
    assert served.client().completions.create(model="localspec", prompt="hi", max_tokens=2).usage.completion_tokens == 2


# ----------------------------------------------------------------- one at a time: queue, disconnect
def test_disconnect_mid_stream_cancels_the_generation(served):
    before = served.health()["generations"]
    c = served.client()
    stream = c.completions.create(model="localspec", prompt=PROMPT, max_tokens=LONG, stream=True)
    got = 0
    for _ in stream:
        got += 1
        if got == 3:
            break
    stream.close()
    h = served.wait_for(lambda h: h["generations"]["cancelled"] > before["cancelled"], "the stream's generation cancelled")
    assert h["generations"]["completed"] == before["completed"] and not h["generating"]
    r = c.completions.create(model="localspec", prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == N


def test_disconnect_while_waiting_non_streamed_cancels(served):
    """A non-streamed request's client that leaves is noticed by polling, and its generation stops."""
    before = served.health()["generations"]
    conn = http.client.HTTPConnection(served.host, int(served.port), timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPT, "max_tokens": LONG}),
                 headers={"Content-Type": "application/json"})
    served.wait_for(lambda h: h["generating"], "a generation running")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    served.wait_for(lambda h: h["generations"]["cancelled"] > before["cancelled"] and not h["generating"],
                    "the generation cancelled")


def test_queue_full_is_503_with_retry_after(served):
    c = served.client(max_retries=0)
    before = served.health()["generations"]
    running = c.completions.create(model="localspec", prompt=PROMPT, max_tokens=LONG, stream=True)
    it = iter(running)
    next(it)  # the first generation is running (out of the queue)
    queued: dict = {}

    def second():
        try:
            queued["r"] = c.completions.create(model="localspec", prompt=PROMPT, max_tokens=N, temperature=0)
        except Exception as exc:  # reported by the assert below
            queued["r"] = exc

    th = threading.Thread(target=second)
    th.start()
    served.wait_for(lambda h: h["queued"] == 1, "one request queued")
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model="localspec", prompt="hi", max_tokens=2)
    assert e.value.status_code == 503 and int(e.value.response.headers["retry-after"]) >= 1
    assert "busy" in str(e.value)
    running.close()  # cancels the first; the queued one runs next
    th.join(60)
    assert not th.is_alive() and not isinstance(queued["r"], Exception), queued
    assert queued["r"].usage.completion_tokens == N
    h = served.health()["generations"]
    assert h["rejected"] == before["rejected"] + 1 and h["cancelled"] == before["cancelled"] + 1


# ----------------------------------------------------------------- the command
def test_serve_command_api_key_and_exposure_warning(target_path, tmp_path):
    env = server_env(tmp_path / "cfg")
    env["LOCALSPEC_API_KEY"] = "s3cret"
    p, url, lines = start_serve(["-m", str(target_path), "--host", "0.0.0.0", "--port", "0", "--method", "none"], env)
    try:
        port = url.rsplit(":", 1)[1]
        assert url.startswith("http://0.0.0.0:")
        warn = "".join(lines)
        assert "warning: listening on 0.0.0.0" in warn and "API key" in warn
        base = f"http://127.0.0.1:{port}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        conn = http.client.HTTPConnection("127.0.0.1", int(port), timeout=30)
        conn.request("GET", "/v1/models")
        r = conn.getresponse()
        assert r.status == 401 and json.loads(r.read())["error"]["code"] == "invalid_api_key"
        conn.request("GET", "/health")  # open without the key
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"
        conn.close()
        ok = openai.OpenAI(base_url=base, api_key="s3cret")
        assert ok.models.list().data[0].id == target_path.name
        assert ok.completions.create(model=target_path.name, prompt="hi", max_tokens=3).usage.completion_tokens == 3
    finally:
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and "localspec serve: stopped" in err.decode() and out == b""
    assert "Traceback" not in err.decode()


def test_serve_loopback_has_no_warning_and_no_auth(target_path, tmp_path):
    p, url, lines = start_serve(["-m", str(target_path), "--port", "0", "--method", "none"],
                                server_env(tmp_path / "cfg"))
    try:
        assert url.startswith("http://127.0.0.1:") and not any("warning" in l for l in lines)
        c = openai.OpenAI(base_url=url + "/v1", api_key="anything")
        assert c.completions.create(model="localspec", prompt="hi", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.BadRequestError, match="draft model"):  # no draft loaded: refused before queueing
            c.completions.create(model="localspec", prompt="hi", max_tokens=2, extra_body={"localspec": {"method": "draft"}})
    finally:
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    assert p.returncode == 0 and "stopped" in err.decode()


@pytest.mark.parametrize("args,needle", [
    (["--queue", "0"], "--queue"),
    (["--port", "70000"], "port"),
    (["--api-key", " "], "API key"),
    (["-t", "-1"], "temperature"),
])
def test_serve_usage_errors(target_path, tmp_path, args, needle):
    r = cli(["serve", "-m", str(target_path), *args], server_env(tmp_path / "cfg"), timeout=60)
    err = r.stderr.decode()
    assert r.returncode == 2 and err.startswith("error: ") and needle in err and "Traceback" not in err, err


def test_serve_port_in_use_is_one_error_line(target_path, tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        r = cli(["serve", "-m", str(target_path), "--port", str(s.getsockname()[1])], server_env(tmp_path / "cfg"))
    finally:
        s.close()
    err = r.stderr.decode().strip()
    assert r.returncode == 1 and err.startswith("error: cannot listen on") and "\n" not in err, err


def test_a_bad_parallel_setting_is_refused_at_start_up(target_path, tmp_path):
    env = server_env(tmp_path / "cfg")
    env["LOCALSPEC_PARALLEL"] = "-1"
    r = cli(["serve", "-m", str(target_path), "--port", "0", "--method", "none"], env, timeout=60)
    err = r.stderr.decode()
    assert r.returncode == 2 and err.startswith("error: ") and "LOCALSPEC_PARALLEL" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_stream_ends_it_with_an_error_event_and_done(target_path, tmp_path, sig):
    p, url, _ = start_serve(["-m", str(target_path), "--port", "0", "--method", "none", "-c", str(CTX)],
                            server_env(tmp_path / "cfg"))
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
    """The CLI calls serve(session, host=, port=, api_key=, queue_size=); the other server settings are optional
    keywords, checked before anything is bound or loaded."""
    from localspec.errors import UsageError
    from localspec.server.main import serve

    with pytest.raises(UsageError, match="max k"):
        serve(object(), port=0, max_k=0)
    with pytest.raises(UsageError, match="--queue"):
        serve(object(), port=0, queue_size=0, cors_origins="http://ui.example", allowed_hosts="*", strict_model=True)


def test_exposure_warning_text():
    from localspec.server.run import exposure_warning

    assert exposure_warning("127.0.0.1", 8080, None) is None
    assert exposure_warning("localhost", 8080, None) is None
    assert exposure_warning("::1", 8080, None) is None
    w = exposure_warning("0.0.0.0", 8080, None)
    assert "WITHOUT authentication" in w and "--api-key" in w
    assert "need the API key" in exposure_warning("192.168.1.5", 8080, "k")


def test_a_client_that_leaves_is_noticed_while_tokens_keep_coming():
    """A non-streamed request's client that leaves is noticed even when tokens arrive more often than POLL_S (a fast
    machine): the disconnect check does not wait for a quiet moment, so the generation stops with its client."""
    import asyncio

    from localspec.core.engine import GenConfig
    from localspec.server import queue as S

    class GoneRequest:
        checks = 0

        async def is_disconnected(self):
            GoneRequest.checks += 1
            return True

    async def main():
        job = S.Job(lambda e: [], GenConfig(), asyncio.get_running_loop(), asyncio.Queue())
        for i in range(100_000):
            job.events.put_nowait(i)
        end = time.monotonic() + 5 * S.POLL_S + 1.0
        while time.monotonic() < end:
            await S.next_event(GoneRequest(), job)
            await asyncio.sleep(0.001)  # a token every millisecond
        return job

    with pytest.raises(S.ClientGone):
        asyncio.run(main())
    assert GoneRequest.checks >= 1


def test_serve_warns_about_a_missing_chat_template_and_takes_one(tmp_path):
    """serve (like chat) warns when the model has no chat template (the plain 'role: content' fallback), and takes
    `--chat-template` as run does."""
    from tinymodels import write_model

    plain_model = write_model(tmp_path / "plain.gguf", 5, chat_template=None)
    p, url, lines = start_serve(["-m", str(plain_model), "--port", "0", "--method", "none"],
                                server_env(tmp_path / "cfg"))
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=60)
    assert any("warning:" in l and "no chat template" in l for l in lines), lines
    tmpl = tmp_path / "t.jinja"
    tmpl.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    p, url, lines = start_serve(["-m", str(plain_model), "--port", "0", "--method", "none", "--chat-template",
                                 str(tmpl)], server_env(tmp_path / "cfg"))
    try:
        assert not any("no chat template" in l for l in lines), lines
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        r = c.chat.completions.create(model="localspec", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.usage.prompt_tokens <= 4  # "hi" and BOS: the given template, not "user: hi\nassistant:"
    finally:
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=60)


def test_per_request_speculation_options(served, plain):
    """A client can choose method, k and exactness for one request (`extra_body={"localspec": {...}}`); bad values
    are a 400 naming the problem, and the server's own settings are untouched."""
    c = served.client(max_retries=0)
    r = c.completions.create(model="localspec", prompt=PROMPT, max_tokens=N, temperature=0,
                             extra_body={"localspec": {"method": "lookup", "k": 2, "exactness": "lossless"}})
    ls = r.model_extra["localspec"]
    assert ls["requested_method"] == "lookup" and ls["requested_k"] == 2 and ls["exactness"] == "lossless"
    assert r.choices[0].text == plain[1]  # still plain decoding's tokens
    r = c.completions.create(model="localspec", prompt=PROMPT, max_tokens=N, extra_body={"localspec": {"method": "none"}})
    assert r.model_extra["localspec"]["drafted"] == 0 and r.choices[0].text == plain[1]
    for bad, needle in (({"method": "magic"}, "method"), ({"k": -1}, "k"), ({"exactness": "exact"}, "exactness"),
                        ({"kk": 2}, "kk")):
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model="localspec", prompt="hi", max_tokens=2, extra_body={"localspec": bad})
        assert needle in str(info.value), (bad, str(info.value))
    r = c.completions.create(model="localspec", prompt=PROMPT, max_tokens=N, temperature=0)
    check_stats(r.model_extra["localspec"])  # the server's defaults again: draft, k <= 3


def test_serve_command_lets_an_allowed_web_ui_in(target_path, tmp_path):
    """--cors-origins and --max-k reach the server: an allowed origin's preflight is answered (no key needed), any
    other origin is refused, and a k above --max-k is a 400 naming the field."""
    env = server_env(tmp_path / "cfg")
    env["LOCALSPEC_API_KEY"] = "s3cret"
    p, url, _ = start_serve(["-m", str(target_path), "--port", "0", "--method", "none", "--cors-origins",
                             "http://ui.example:5173", "--max-k", "2"], env)
    try:
        port = int(url.rsplit(":", 1)[1])

        def ask(method, path, headers, body=None):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request(method, path, body=body, headers=headers)
            r = conn.getresponse()
            return r.status, dict((k.lower(), v) for k, v in r.getheaders()), r.read()

        pre = {"Origin": "http://ui.example:5173", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}
        status, headers, _ = ask("OPTIONS", "/v1/chat/completions", pre)
        assert status == 200 and headers.get("access-control-allow-origin") == "http://ui.example:5173"
        body = json.dumps({"prompt": "hi", "max_tokens": 2, "localspec": {"k": 3}})
        auth = {"Authorization": "Bearer s3cret", "Content-Type": "application/json"}
        status, _, _ = ask("POST", "/v1/completions", {**auth, "Origin": "http://evil.example"}, body)
        assert status == 403
        status, _, data = ask("POST", "/v1/completions", {**auth, "Origin": "http://ui.example:5173"}, body)
        assert status == 400 and json.loads(data)["error"]["param"] == "localspec.k"
    finally:
        p.terminate()
        p.wait(30)


def test_a_stop_signal_right_after_the_ready_line_stops_the_server(target_path):
    """A SIGINT sent as soon as the ready line is printed, before uvicorn has installed its own handlers, stops the
    server the way uvicorn's handler does: not a KeyboardInterrupt raised wherever the main thread is (inside
    importlib's lock callback it would be swallowed, "Exception ignored in ...", and the server would run on)."""
    from localspec.server.main import serve
    from localspec.session import Session

    sess = Session({"model": str(target_path), "method": "none"}, quiet=True)
    lines = []

    def log(line):
        lines.append(line)
        if line.startswith("localspec serve: http://"):
            os.kill(os.getpid(), signal.SIGINT)  # the ready line is out: a supervisor stops the server now

    serve(sess, port=0, log=log)  # returns: no KeyboardInterrupt out of it, no hang
    assert lines[-1] == "localspec serve: stopped", lines
