"""Helpers shared by the test modules (fixtures live in conftest.py): the CLI as a subprocess and its one-line
errors, `localspec worker` and `localspec serve` processes, an in-process server on a free port, and model files
whose strings hold terminal escapes."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import uvicorn

from tinymodels import CHATML, TOOL_TEMPLATE

# LOCALSPEC_* variables a test keeps from the environment it runs in: the suite's cache and data dirs (so no test
# writes into the user's) and the real models' folder
KEPT_ENV = ("LOCALSPEC_CACHE_DIR", "LOCALSPEC_DATA_DIR", "LOCALSPEC_TEST_MODELS")


# ------------------------------------------------------------------ the CLI
def environ(changes=None) -> dict:
    """This process's environment with `changes` applied (a value None removes that variable)."""
    e = dict(os.environ)
    for k, v in (changes or {}).items():
        if v is None:
            e.pop(k, None)
        else:
            e[k] = v
    return e


def cli(args, env=None, stdin=b"", timeout=120) -> subprocess.CompletedProcess:
    """`python -m localspec ARGS` as a subprocess, stdout and stderr captured as bytes; `env`: changes to this
    process's environment for it (see environ)."""
    return subprocess.run([sys.executable, "-m", "localspec", *args], input=stdin, capture_output=True,
                          timeout=timeout, env=environ(env))


def one_error_line(r, code: int | None = 2) -> str:
    """The product's rule for bad input: exit `code` (None: any non-zero) and stderr one `error: ` line, no
    traceback, no debugger backtrace. Returns that line."""
    err = r.stderr.decode()
    if code is None:
        assert r.returncode != 0, (r.returncode, err)
    else:
        assert r.returncode == code, (r.returncode, err)
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and "gdb" not in err
    return lines[0]


def run_main(args, capsys, monkeypatch):
    """The entry point in-process (so a test can stub the exactness probe): (exit code, stdout, stderr)."""
    import io

    import pytest

    from localspec.cli.app import main

    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # nothing piped
    with pytest.raises(SystemExit) as exc:
        main(args)
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def clean_env(mp, cfg_dir) -> None:
    """With MonkeyPatch `mp`: no LOCALSPEC_* setting from the caller's environment (KEPT_ENV aside), the config in
    `cfg_dir`."""
    for k in list(os.environ):
        if k.startswith("LOCALSPEC_") and k not in KEPT_ENV:
            mp.delenv(k)
    mp.setenv("LOCALSPEC_CONFIG_DIR", str(cfg_dir))


@contextlib.contextmanager
def loaded_session(settings: dict, cfg_dir):
    """A Session with `settings`, loaded under clean_env (no LOCALSPEC_* setting from the caller's environment, the
    config in `cfg_dir`); closed at the end of the block."""
    import pytest

    from localspec.session import Session

    with pytest.MonkeyPatch.context() as mp:
        clean_env(mp, cfg_dir)
        sess = Session(settings, quiet=True)
        try:
            sess.load()
            yield sess
        finally:
            sess.close()


def start_long(model, *extra) -> subprocess.Popen:
    """`run` on `model` (see the long_model fixture) asked for 59000 tokens: a generation a test stops midway. The
    tiny model drafts almost every token by lookup, at thousands of tokens per second, so the answer must outlast the
    tests' wait for it to start (6 s of the process's CPU time) by a wide margin."""
    return subprocess.Popen([sys.executable, "-m", "localspec", "run", "-m", str(model), "-c", "60000", "-n", "59000",
                             "--method", "lookup", "--raw", *extra, "the cat"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


# ------------------------------------------------------------------ generations
def gen_config(method="draft", max_tokens=100, k=4, **kw):
    """A GenConfig for `method` at draft length `k`, `max_tokens` long; `kw`: its other fields."""
    from localspec.core.engine import GenConfig

    return GenConfig(method=method, k=k, max_tokens=max_tokens, **kw)


def alone(engine, prompt, cfg):
    """`engine`'s answer to `prompt` (text, or tokens) on its single-sequence path: what a batched request must
    give."""
    return engine.complete(engine.raw_prompt(prompt) if isinstance(prompt, str) else list(prompt), cfg)


def second_tokens(engine, prompt: list[int], method: str, seed0: int, n: int, **kw):
    """`n` answers of 3 tokens sampled at temperature 1 (seeds seed0, seed0 + 1, ...), whose 2nd and 3rd tokens
    come from one speculative step with k = 1: (how often each 2nd token came, -1 where the answer ended first;
    tokens drafted; tokens accepted) over all of them. `kw`: the GenConfig's other fields."""
    from localspec.core.engine import GenConfig
    from localspec.sample.sampling import SamplingParams

    counts, drafted, accepted = {}, 0, 0
    for i in range(n):
        r = engine.complete(prompt, GenConfig(method=method, k=3, max_tokens=3,
                                              sampling=SamplingParams(temperature=1.0, seed=seed0 + i), **kw))
        key = r.tokens[1] if len(r.tokens) > 1 else -1
        counts[key] = counts.get(key, 0) + 1
        drafted += r.stats.drafted
        accepted += r.stats.accepted
    return counts, drafted, accepted


def assert_same_distribution(a: dict, b: dict) -> None:
    """Chi-square homogeneity of two samples' counts over the outcomes seen 20 times or more in both together: at
    least 4 such outcomes, and chi-square under its mean + 4.5 standard deviations + 10 (a loose bound that still
    fails a wrong acceptance rule: test_verify.py)."""
    import numpy as np

    keys = [k for k in set(a) | set(b) if a.get(k, 0) + b.get(k, 0) >= 20]
    chi2 = sum((a.get(k, 0) - b.get(k, 0)) ** 2 / (a.get(k, 0) + b.get(k, 0)) for k in keys)
    dof = len(keys) - 1
    assert dof >= 3
    assert chi2 < dof + 4.5 * np.sqrt(2 * dof) + 10, (chi2, dof)


# A verify row equals the one-token decode of its position only up to llama.cpp's float order: on CPU the KV view
# a decode attends over is padded differently when rows arrive in batches, which moves logits by up to ~5e-3 on the
# tiny F16 model (also at exactness bit, whose probe compares batch shapes on one cache layout). Log-softmax moves
# by at most twice that, so logprobs are compared within LOGPROB_TOL and tokens exactly.
LOGPROB_TOL = 1e-2


# ------------------------------------------------------------------ RPC workers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """A `localspec worker` subprocess; its stderr is collected in .lines."""

    def __init__(self, *args, port=None):
        self.port = port or free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "localspec", "worker", "--port", str(self.port), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.out: list[str] = []
        self._ready = threading.Event()
        self._readers = [threading.Thread(target=self._read, args=(self.proc.stderr, self.lines, True), daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stdout, self.out, False), daemon=True)]
        for t in self._readers:
            t.start()
        if not self._ready.wait(60) or not any(l.startswith("worker listening on") for l in self.lines):
            self.kill()
            raise RuntimeError("worker did not start: " + "".join(self.lines))

    def _read(self, stream, into, signals):
        for line in stream:
            into.append(line)
            if signals and line.startswith("worker listening on"):
                self._ready.set()
        if signals:
            self._ready.set()  # it ended: let the constructor report it

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def interrupt(self, timeout=15) -> int:
        self.proc.send_signal(signal.SIGINT)
        rc = self.proc.wait(timeout)
        for t in self._readers:  # everything it said, up to its end
            t.join(timeout)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


# ------------------------------------------------------------------ `localspec serve`
PROMPT = "the cat and the dog"
LONG = 100_000  # more than the context holds: a generation that runs until it is cancelled
CTX = 8192
KEY = "k3y"  # the API key of the servers that need one


def server_env(cfg_dir) -> dict:
    """Environment changes (see environ) for a `localspec` subprocess beside a test server: no LOCALSPEC_* setting
    from the caller's environment (KEPT_ENV aside), the config in `cfg_dir`, the hub offline."""
    gone = {k: None for k in os.environ if k.startswith("LOCALSPEC_") and k not in KEPT_ENV}
    return gone | {"LOCALSPEC_CONFIG_DIR": str(cfg_dir), "HF_HUB_OFFLINE": "1"}


class Served:
    """A running server: its URL, app and session, an `openai` client on it and raw HTTP requests."""

    def __init__(self, url, app, session, env):
        self.url, self.app, self.session, self.env = url, app, session, env
        self.host, self.port = url.split("//")[1].split("/")[0].split(":")

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "unused"), **kw)

    def raw(self, method, path, body=None, headers=None):
        """(status, headers, parsed JSON) for a hand-made request (malformed bodies the client would not send)."""
        headers = dict(headers or {})
        if method == "POST" and not any(k.lower() == "content-type" for k in headers):
            headers["Content-Type"] = "application/json"  # what every JSON client sends (other types: 415)
        conn = http.client.HTTPConnection(self.host, int(self.port), timeout=60)
        try:
            conn.request(method, path, body=body, headers=headers)
            r = conn.getresponse()
            data = r.read()
            try:
                parsed = json.loads(data) if data else None
            except ValueError:  # a CORS preflight's "OK"
                parsed = data.decode(errors="replace")
            return r.status, dict(r.getheaders()), parsed
        finally:
            conn.close()

    def health(self):
        return self.raw("GET", "/health")[2]

    def wait_for(self, pred, what, timeout=60.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            h = self.health()
            if pred(h):
                return h
            time.sleep(0.02)
        raise AssertionError(f"server never reached: {what}; /health says {self.health()}")


def post(s: Served, path, body, **headers):
    """A POST of `body` (a dict is sent as JSON) with `headers`: (status, headers, parsed JSON)."""
    return s.raw("POST", path, body if isinstance(body, (bytes, str)) else json.dumps(body), headers)


def chat(prompt: str, **kw) -> dict:
    """A chat completion request for `prompt`: greedy, 40 tokens unless `kw` says otherwise."""
    return {"model": "x", "messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "temperature": 0, **kw}


def completed(s: Served, body: dict) -> dict:
    """The JSON answer of POST /v1/chat/completions `body`, which must succeed."""
    status, _, data = post(s, "/v1/chat/completions", body)
    assert status == 200, data
    return data


def text(r: dict) -> str:
    """A chat completion's answer text."""
    return r["choices"][0]["message"]["content"]


def at_once(s: Served, bodies: list[dict]) -> list[dict]:
    """Every chat completion of `bodies` sent at the same moment, one thread each: their answers, in order."""
    out: list = [None] * len(bodies)
    go = threading.Barrier(len(bodies))

    def one(i):
        go.wait()
        out[i] = completed(s, bodies[i])
    ths = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in ths:
        t.start()
    for t in ths:
        t.join(120)
    return out


@contextlib.contextmanager
def running(app):
    """A real uvicorn server for `app` on a free loopback port, in a thread; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    end = time.monotonic() + 30
    while not server.started and time.monotonic() < end:
        time.sleep(0.01)
    assert server.started
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        th.join(30)


@contextlib.contextmanager
def serving(session, config):
    """The server app for a loaded `session` with ServerConfig `config`, running: yields a Served."""
    from localspec.server.app import create_app

    app = create_app(session, config, log=lambda m: None)
    try:
        with running(app) as url:
            yield Served(url, app, session, None)
    finally:
        assert app.state.worker.stop(timeout=30)


def start_serve(args, env):
    """`localspec serve ARGS` as a subprocess with environment changes `env` (see environ), once it prints its
    ready line: (process, base URL, the stderr lines so far)."""
    p = subprocess.Popen([sys.executable, "-m", "localspec", "serve", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=environ(env))
    lines = []
    end = time.monotonic() + 120
    while time.monotonic() < end:
        line = p.stderr.readline().decode()
        if not line:
            break
        lines.append(line)
        m = re.match(r"localspec serve: (http://\S+)/v1 \(model (\S+)\)$", line.strip())
        if m:
            return p, m.group(1), lines
    p.kill()
    raise AssertionError("no ready line: " + "".join(lines) + p.stderr.read().decode())


# ------------------------------------------------------------------ tool calls
# the forms small models write a call in, whatever their template shows (Qwen2.5-Coder: a fenced, indented block,
# or the doubled braces its template prints)
WRITTEN = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "fenced": '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
    "fenced, no language": '```\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
    "bare": '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "doubled braces": '{{"name": "get_weather", "arguments": {"city": "Paris"}}}',
    "all braces doubled": '{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}',
    "fenced, doubled": '```json\n{{"name": "get_weather", "arguments": {"city": "Paris"}}}\n```',
    "arguments as text": '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',
    "generic": '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}',
}


def answered_by_generate(monkeypatch) -> None:
    """The server's scheduler answers each request with its engine's `generate` (looked up per request, so a test
    may replace it), streamed as it yields: a test double's answers, failures and pauses reach the client as a real
    generation's events would."""
    from localspec.core.batch import BatchEngine
    from localspec.core.response import Response

    class Pulled(Response):
        def __init__(self, events) -> None:
            super().__init__()
            self._events = events

        def listen(self, fn):
            super().listen(fn)
            try:
                for ev in self._events:
                    self.push(ev)
            except Exception as exc:  # the request's error, as the scheduler passes it on
                self.push(exc)
            return self

    def submit(self, prompt_tokens, cfg=None, cancel=None):
        return Pulled(self.engine.generate(prompt_tokens, cfg, cancel))

    monkeypatch.setattr(BatchEngine, "submit", submit)


class Scripted:
    """Replaces the served engine's generation with fixed answers, one per request, and keeps each prompt the chat
    template rendered."""

    def __init__(self, monkeypatch, engine, answers, template=TOOL_TEMPLATE):
        """`template`: the chat template to serve with (None: the model's own, a ChatML that shows no tools)."""
        from localspec.core.chat_template import ChatTemplate

        self.answers, self.prompts, self.constraints = list(answers), [], []
        outer = self

        class Recording(ChatTemplate):
            def segments(self, messages, add_generation_prompt=True, tools=None, **kw):
                segs = super().segments(messages, add_generation_prompt, tools=tools, **kw)
                outer.prompts.append("".join(s.text for s in segs))
                return segs

        tmpl = Recording(template or CHATML, origin="the test template")
        monkeypatch.setattr(engine, "chat_template", lambda: tmpl)
        monkeypatch.setattr(engine, "generate", self.generate)
        answered_by_generate(monkeypatch)

    def generate(self, tokens, cfg, cancel=None):
        from localspec.core.engine import Finished, Piece
        from localspec.core.stats import Stats

        text = self.answers.pop(0)
        self.constraints.append(cfg.constraint)
        st = Stats(prompt_tokens=len(tokens))
        pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
        for i, p in enumerate(pieces):
            st.token_emitted(now=float(i))
            yield Piece(p, i, False)
        st.elapsed_s = 1.0
        yield Finished(text, list(range(len(pieces))), "stop", st)


def accepts(grammar: str, text: str) -> bool:
    import llguidance

    from localspec.server.grammar import _byte_tokenizer

    m = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    return m.consume_tokens(list(text.encode())) and m.is_accepting()


# ------------------------------------------------------------------ strings from model files on a terminal
EVIL = "\x1b]0;pwned\x07\x1b[2J"  # sets a terminal's title, then clears its screen


def evil_model(path: Path, **kw) -> Path:
    """A tiny model whose general.name holds terminal escapes (OSC title, BEL, CSI clear screen)."""
    import tinymodels

    orig = tinymodels.llama_kv

    def named(wr, name, *a):
        orig(wr, f"tiny{EVIL}", *a)

    tinymodels.llama_kv = named
    try:
        return tinymodels.write_model(path, 3, **kw)
    finally:
        tinymodels.llama_kv = orig


def no_controls(text: str) -> None:
    import unicodedata

    bad = sorted({hex(ord(c)) for c in text if unicodedata.category(c) == "Cc" and c not in "\n"})
    assert not bad, (bad, text)


@contextlib.contextmanager
def recording_decodes(ms, what=lambda parts: {p[0] for p in parts}):
    """`what(parts)` of every decode of `ms` (a MultiSeq) while the block runs: by default its sequences."""
    decode, seen = ms.decode, []

    def recording(parts, *args, **kw):
        seen.append(what(parts))
        return decode(parts, *args, **kw)

    ms.decode = recording
    try:
        yield seen
    finally:
        ms.decode = decode
