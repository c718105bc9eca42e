"""`serve --parallel N` keeps prompt states (core/prompt_cache.py, core/batch.py): a request whose prompt's start no
slot holds any more restores it from memory, or after a restart from disk, and answers what it answers without the
cache; `prompt_cache false` (serve --no-prompt-cache) keeps nothing."""

from __future__ import annotations

import contextlib
import signal
import threading

import pytest

from helpers import Served, clean_env, post, recording_decodes, server_env, serving, start_serve
from localspec.store import prompt_states as PS

CTX = 2048
CHUNK = 256  # the batch's prompt chunk (core/batch.PREFILL_CHUNK): a kept state is of whole chunks from 0
A = "the cat and the dog and x = y + 1 " * 25  # > 2 chunks with the tiny model's tokenizer
A2 = "x = y + 1 and the cat and the dog " * 25
B = "Once upon a time there was a dog. " * 5  # < 1 chunk: no state of its own
C = "def f(x): return x + 1\n" * 5


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def states(cache) -> list:
    return sorted((cache / PS.FOLDER).glob("*.state"))


@contextlib.contextmanager
def server(target_path, cfg_dir, *, prompt_cache=True, ram=1 << 30, parallel=2):
    """A server of the tiny target (prompt lookup, k 4) with `parallel` slots over separate KV streams and its prompt
    store made as `serve` makes it (server/main.py: ServerStates of `ram` bytes over the disk store)."""
    from localspec.server.config import ServerConfig
    from localspec.session import Session

    with pytest.MonkeyPatch.context() as mp:
        clean_env(mp, cfg_dir)
        sess = Session({"model": str(target_path), "method": "lookup", "draft_tokens": 4, "ctx_size": CTX,
                        "prompt_cache": prompt_cache}, quiet=True)
        sess.prompt_states, sess.prompt_cache_ram = True, ram
        try:
            sess.load()
            with serving(sess, ServerConfig(parallel=parallel, kv_layout="split", queue_size=4)) as s:
                yield s
        finally:
            sess.close()


def complete(s, prompt: str) -> dict:
    status, _, data = post(s, "/v1/completions", {"model": "x", "prompt": prompt, "max_tokens": 24, "temperature": 0})
    assert status == 200, data
    return data


def answer(r: dict) -> str:
    return r["choices"][0]["text"]


def cached(r: dict) -> int:
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def evict_a(s) -> None:
    """B and C sent at once, one slot each: no slot holds A's start any more."""
    out: list = [None, None]
    threads = [threading.Thread(target=lambda i=i, p=p: out.__setitem__(i, complete(s, p)))
               for i, p in enumerate((B, C))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in out)
    a = s.session.engine.target.tokenize(A, add_special=True, parse_special=False)
    assert all(t[:8] != a[:8] for t in s.app.state.worker.batch.ms.tokens)


def test_a_prompt_evicted_from_every_slot_is_restored_from_memory_with_the_same_answer(target_path, tmp_path, cache):
    with server(target_path, tmp_path / "cfg0", prompt_cache=False) as s:
        cold = complete(s, A)
    with server(target_path, tmp_path / "cfg") as s:
        first = complete(s, A)
        n = first["usage"]["prompt_tokens"]
        assert n > 2 * CHUNK + 1 and cached(first) == 0
        kept = (n - 1) // CHUNK * CHUNK  # the last whole chunk before the prompt's last token
        evict_a(s)
        again = complete(s, A)
        assert cached(again) == kept and again["localspec"]["prompt_cache"] == "memory"
        assert answer(again) == answer(first) == answer(cold)
        assert again["localspec"]["exactness"] == first["localspec"]["exactness"] == cold["localspec"]["exactness"]
        assert again["usage"]["completion_tokens"] == first["usage"]["completion_tokens"]
    assert len(states(cache)) == 1  # the batch's state of A's first chunks, on disk too


def test_a_restarted_server_restores_from_disk(target_path, tmp_path, cache):
    with server(target_path, tmp_path / "cfg") as s:
        first = complete(s, A)
    assert len(states(cache)) == 1
    with server(target_path, tmp_path / "cfg") as s:  # a new process's store: nothing in memory
        again = complete(s, A)
        assert again["localspec"]["prompt_cache"] == "disk" and cached(again) == (first["usage"]["prompt_tokens"]
                                                                                   - 1) // CHUNK * CHUNK
        assert answer(again) == answer(first)
        evict_a(s)
        third = complete(s, A)  # read from disk once: in memory since
        assert third["localspec"]["prompt_cache"] == "memory" and cached(third) == cached(again)
        assert answer(third) == answer(first)


def test_memory_off_restores_from_disk(target_path, tmp_path, cache):
    with server(target_path, tmp_path / "cfg", ram=0) as s:
        first = complete(s, A)
        evict_a(s)
        again = complete(s, A)
        assert again["localspec"]["prompt_cache"] == "disk" and cached(again) > CHUNK
        assert answer(again) == answer(first)


def test_no_prompt_cache_keeps_nothing(target_path, tmp_path, cache):
    with server(target_path, tmp_path / "cfg", prompt_cache=False) as s:
        assert s.app.state.worker.batch.states is None
        first = complete(s, A)
        evict_a(s)
        again = complete(s, A)
        assert cached(again) < CHUNK and again["localspec"]["prompt_cache"] in ("", "memory")
        assert answer(again) == answer(first)
    assert states(cache) == []


@contextlib.contextmanager
def serve_cli(target_path, cfg_dir, *extra, env=None):
    """`localspec serve --parallel 2` on the tiny target as a subprocess (server/main.py makes its store): a Served
    of its URL; stopped with SIGTERM at the end."""
    args = ["-m", str(target_path), "--port", "0", "--parallel", "2", "--kv-layout", "split", "--method", "lookup",
            "-k", "4", "-c", str(CTX), *extra]
    p, url, _ = start_serve(args, server_env(cfg_dir) | (env or {}))
    try:
        yield Served(url, None, None, None)
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err.decode()[-3000:]


def test_serve_restarted_restores_from_disk_and_no_prompt_cache_keeps_nothing(target_path, tmp_path, cache):
    with serve_cli(target_path, tmp_path / "cfg") as s:
        first = complete(s, A)
    assert len(states(cache)) == 1
    with serve_cli(target_path, tmp_path / "cfg", "--prompt-cache-ram", str(64 << 20)) as s:
        again = complete(s, A)
    assert again["localspec"]["prompt_cache"] == "disk" and cached(again) >= CHUNK
    assert answer(again) == answer(first)
    with serve_cli(target_path, tmp_path / "cfg", "--no-prompt-cache") as s:
        one = complete(s, A)  # its state is on disk: not restored
        for p in (B, C, A2, A):
            last = complete(s, p)
    assert cached(one) == 0 and cached(last) < CHUNK and answer(last) == answer(first)
    assert len(states(cache)) == 1  # nothing kept of A2


def test_a_prompt_joining_beside_a_running_answer_keeps_no_state(target_path, cache):
    """Only a prefix decoded as a cold prefill in the batch decodes it (whole chunks, each alone in its decode) is
    kept: the chunks of a prompt that share their decodes with another request's rows are not; the same prompt
    alone is."""
    from localspec.core.batch import BatchEngine
    from localspec.core.engine import Engine, GenConfig
    from localspec.core.prompt_cache import PromptCache, ServerStates
    from localspec.store.prompt_states import PromptStates

    e = Engine.load(target_path, n_ctx=CTX)
    e.prompt_cache = PromptCache(ServerStates(1 << 30, PromptStates()))
    b = BatchEngine(e, 2, layout="split")
    try:
        assert b.ms.cold_chunk == CHUNK
        tok = lambda t: e.target.tokenize(t, add_special=True, parse_special=False)  # noqa: E731
        b.probe()
        stop = threading.Event()
        b.submit(tok(B), GenConfig(max_tokens=1000, method="none", k=0), cancel=stop)
        b.step()
        b.step()  # B generates
        with recording_decodes(b.ms) as seen:
            r = b.submit(tok(A), GenConfig(max_tokens=4, method="none", k=0))
            seq = next(run.seq for run in b.runs if run is not None and run.seq != 0)
            while b.runs[seq] is not None:
                b.step()
        assert seq == 1 and r.result().stats.cached_prompt_tokens < CHUNK
        if {0, 1} in seen[:2]:  # its first chunk shared a decode with B's row (not decoded apart: _apart)
            assert b.ms.cold[1] == 0 and states(cache) == [] and b.states.memory.bytes == 0
        stop.set()
        while b.active:
            b.step()
        b.ms.clear()
        alone = b.submit(tok(A), GenConfig(max_tokens=4, method="none", k=0))
        while b.active:
            b.step()
        assert alone.result().stats.cached_prompt_tokens < CHUNK
        assert len(states(cache)) == 1 and b.states.memory.bytes > 0
    finally:
        b.close()
        e.close()
