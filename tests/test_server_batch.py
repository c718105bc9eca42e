"""`localspec serve --parallel N`: requests decoded together (core/batch.py) answer what they answer one at a time;
a client that leaves mid-batch leaves the others unchanged; /health and /metrics show the slots."""

from __future__ import annotations

import http.client
import json
import signal
import threading

import pytest

from conftest import require_exact_batching
from helpers import (Served, at_once, chat, cli, completed, loaded_session, one_error_line, recording_decodes,
                     server_env, serving, start_serve, text)

CTX = 2048
PROMPTS = ["the cat and the dog", "def f(x): return x", "Hello world, the x = y + 1", "Once upon a time"]


@pytest.fixture(scope="module")
def batched(target_path, tmp_path_factory):
    """`serve --parallel 4` with prompt lookup (k 4) on the tiny target, per module."""
    from localspec.server.config import ServerConfig

    with loaded_session({"model": str(target_path), "method": "lookup", "draft_tokens": 4, "ctx_size": CTX},
                        tmp_path_factory.mktemp("cfg")) as sess:
        with serving(sess, ServerConfig(parallel=4, queue_size=8)) as s:
            yield s


def decodes(s: Served):
    """The sequences of every batched decode while the block runs (one set per llama_decode)."""
    return recording_decodes(s.app.state.worker.batch.ms)


def test_health_and_metrics_show_the_slots(batched, exact_batching):
    require_exact_batching(exact_batching)
    h = batched.health()
    assert h["slots"] == 4 and h["active_slots"] == 0 and not h["generating"]
    # --kv-layout auto keeps separate streams where a full batch is bit-identical (the tiny F16 model)
    h = batched.wait_for(lambda h: h["kv_layout"] != "auto", "the probe chose the layout")
    assert h["kv_layout"] == "split"
    status, _, _ = batched.raw("GET", "/metrics")
    conn = http.client.HTTPConnection(batched.host, int(batched.port), timeout=30)
    conn.request("GET", "/metrics")
    m = conn.getresponse().read().decode()
    conn.close()
    assert "localspec:num_slots 4.0" in m and "localspec:num_slots_active 0.0" in m


@pytest.mark.parametrize("method", ["none", "lookup"])
def test_four_concurrent_requests_equal_four_sequential_ones(batched, method):
    bodies = [chat(p, localspec={"method": method}) for p in PROMPTS]
    seq = [completed(batched, b) for b in bodies]
    worker = batched.app.state.worker
    steps0 = worker.batch.steps
    got = at_once(batched, bodies)
    assert [text(r) for r in got] == [text(r) for r in seq]
    for r in got:
        ls = r["localspec"]
        assert ls["exactness"] in ("bit", "lossless") and "batched" in ls["exactness_reason"]
    # decoded together: the four took fewer batched steps than their tokens
    assert worker.batch.steps - steps0 < sum(r["usage"]["completion_tokens"] for r in got)
    assert batched.health()["generations"]["failed"] == 0


def test_a_client_leaving_mid_batch_leaves_the_others_unchanged(batched):
    bodies = [chat(p, max_tokens=60) for p in PROMPTS[:3]]
    seq = [completed(batched, b) for b in bodies]
    before = batched.health()["generations"]
    leaver = http.client.HTTPConnection(batched.host, int(batched.port), timeout=60)
    out: list = [None] * 3

    def one(i):
        out[i] = completed(batched, bodies[i])
    leaver.request("POST", "/v1/chat/completions", body=json.dumps(chat(PROMPTS[3], max_tokens=100_000, stream=True)),
                   headers={"Content-Type": "application/json"})
    r = leaver.getresponse()
    assert r.status == 200
    r.readline()  # the stream is running
    ths = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in ths:
        t.start()
    batched.wait_for(lambda h: h["active_slots"] >= 2, "the others joining the batch")
    leaver.sock.shutdown(2)
    leaver.close()
    for t in ths:
        t.join(120)
    assert [text(x) for x in out] == [text(x) for x in seq]
    h = batched.wait_for(lambda h: h["generations"]["cancelled"] > before["cancelled"], "the leaver cancelled")
    assert h["generations"]["completed"] == before["completed"] + 3


def test_schema_tools_logprobs_and_plain_requests_are_decoded_together(batched):
    """What agents send: a json_schema, a forced tool call, logprobs and a plain request join one batch (one decode
    holds all four) and each answers what it answers alone."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}, "required": ["name"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}}]
    bodies = [chat(PROMPTS[0], response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
              chat(PROMPTS[1], tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   max_tokens=200),
              chat(PROMPTS[2], logprobs=True, top_logprobs=2),
              chat(PROMPTS[3])]
    alone = [completed(batched, b) for b in bodies]
    with decodes(batched) as seen:
        got = at_once(batched, bodies)
    assert any(len(s) == 4 for s in seen)
    def message(r):  # a tool call's id is new each time
        m = dict(r["choices"][0]["message"])
        m["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in m.get("tool_calls") or ()]
        return m

    for a, b in zip(alone, got):
        assert message(b) == message(a)
    assert json.loads(text(got[0]))["name"] is not None
    assert got[1]["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert [t["token"] for t in got[2]["choices"][0]["logprobs"]["content"]] == \
        [t["token"] for t in alone[2]["choices"][0]["logprobs"]["content"]]
    assert batched.health()["generations"]["failed"] == 0


@pytest.mark.parametrize("value", ["0", "65"])
def test_serve_parallel_out_of_range_is_a_usage_error(target_path, tmp_path, value):
    r = cli(["serve", "-m", str(target_path), "--parallel", value], server_env(tmp_path / "cfg"), timeout=60)
    err = r.stderr.decode()
    assert r.returncode == 2 and err.startswith("error: ") and "--parallel" in err and "Traceback" not in err, err


def test_the_default_is_one_slot_on_cpu_and_four_on_a_gpu():
    from localspec.server.config import PARALLEL_CPU, PARALLEL_GPU, ServerConfig

    assert ServerConfig().resolved(3).parallel == PARALLEL_CPU == 1
    assert ServerConfig().resolved(3, on_gpu=True).parallel == PARALLEL_GPU == 4
    assert ServerConfig(parallel=2).resolved(3, on_gpu=True).parallel == 2


def test_serve_kv_layout_is_checked_before_anything_loads(target_path, tmp_path):
    r = cli(["serve", "-m", str(target_path), "--parallel", "4", "--kv-layout", "shared"],
            server_env(tmp_path / "cfg"), timeout=60)
    assert "--kv-layout" in one_error_line(r)


@pytest.mark.parametrize("parallel,method", [("4", "lookup"), ("1", "auto")])
def test_serve_probes_and_calibrates_before_it_says_ready_and_a_second_start_reads_the_cache(target_path, tmp_path,
                                                                                            parallel, method):
    """The batch exactness probe and the verify-cost calibration run before the ready line (after it, the first
    request would wait for them, seconds of decodes in neither the log nor its ttft_s, while /health says ok),
    cached per model and build: a second start measures nothing. (One request at a time, the calibration is what
    method auto's controller starts from.)"""
    env = server_env(tmp_path / "cfg") | {"LOCALSPEC_CACHE_DIR": str(tmp_path / "cache")}
    batched = parallel != "1"
    layouts = []
    for start in (1, 2):
        p, url, lines = start_serve(["-m", str(target_path), "--port", "0", "--parallel", parallel, "--method", method,
                                     "-c", str(CTX)], env)
        try:
            said = "".join(lines)
            # decided before the ready line, not after it
            conn = http.client.HTTPConnection(*url.split("//")[1].split(":"), timeout=60)
            conn.request("GET", "/health")
            h = json.loads(conn.getresponse().read())
            conn.close()
            assert h["kv_layout"] in (("split", "unified") if batched else ("single",)), h
            layouts.append(h["kv_layout"])
            if batched:
                assert f"--parallel {parallel}: " + ("one unified KV cache" if h["kv_layout"] == "unified"
                                                     else "separate KV") in said
            measured = ("checking whether requests decoded together stay bit-exact" in said,
                        "measuring what a verify batch costs" in said)
            assert measured == ((batched, True) if start == 1 else (False, False)), said
        finally:
            p.send_signal(signal.SIGTERM)
            _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err.decode()
    assert layouts[0] == layouts[1]


def test_n_choices_are_generations_of_their_own_decoded_together(batched):
    """n > 1: each choice samples with its own stream (seed + i), equals that request sent alone, and the choices
    share the batch's decodes; usage counts every choice, the prompt once."""
    body = chat(PROMPTS[0], temperature=2.0, top_p=1.0, seed=7, n=3, max_tokens=24)
    with decodes(batched) as seen:
        r = completed(batched, body)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert any(len(s) == 3 for s in seen)
    alone = [completed(batched, {**body, "n": 1, "seed": 7 + i}) for i in range(3)]
    assert [c["message"]["content"] for c in r["choices"]] == [text(a) for a in alone]
    assert len({c["message"]["content"] for c in r["choices"]}) > 1  # the streams differ
    assert r["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
    assert r["usage"]["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]


def test_n_choices_stream_with_their_index(batched):
    body = chat(PROMPTS[1], temperature=2.0, seed=3, n=2, max_tokens=16, stream=True,
                stream_options={"include_usage": True})
    conn = http.client.HTTPConnection(batched.host, int(batched.port), timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    raw = conn.getresponse().read().decode()
    conn.close()
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] += ch["delta"].get("content") or ""
    usage = [c for c in chunks if c.get("usage")]
    assert len(usage) == 1 and usage[0]["choices"] == []
    whole = completed(batched, {**body, "stream": False, "stream_options": None})
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in whole["choices"]]
    assert usage[0]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
