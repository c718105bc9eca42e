"""`localspec serve`'s GET /metrics: Prometheus text that prometheus_client's own parser reads, with llama-server /
vLLM names under `localspec:`, counters that move with each request, and `no_metrics` / `--no-metrics`."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import parser

from helpers import KEY, serving


def scrape(s, **headers) -> dict:
    """{(sample name, frozenset(labels)): value} of one scrape."""
    req = urllib.request.Request(s.url + "/metrics", headers=headers)
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for fam in parser.text_string_to_metric_families(text):
        for smp in fam.samples:
            out[(smp.name, frozenset(smp.labels.items()))] = smp.value
    return out


def v(m, name, **labels):
    return m.get((name, frozenset(labels.items())), 0.0)


SPEC = "localspec:spec_decode_"


def test_metrics_parse_and_the_counters_move_after_a_request(open_api):
    before = scrape(open_api)
    for name in ("localspec:requests_total", "localspec:num_requests_waiting", "localspec:generation_tokens_total",
                 SPEC + "num_drafts_total", SPEC + "num_draft_tokens_total", SPEC + "num_accepted_tokens_total",
                 "localspec:time_to_first_token_seconds_count", "localspec:inter_token_latency_seconds_count"):
        assert any(k[0] == name for k in before), name
    assert v(before, "localspec:num_requests_waiting") == 0
    c = open_api.client(max_retries=0)
    r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": "count to ten"}], max_tokens=12)
    ls = r.model_extra["localspec"]
    after = scrape(open_api)
    d = lambda name, **lb: v(after, name, **lb) - v(before, name, **lb)  # noqa: E731
    assert d("localspec:requests_total", outcome="completed") == 1
    assert d("localspec:generation_tokens_total") == r.usage.completion_tokens > 0
    assert d("localspec:prompt_tokens_total") == r.usage.prompt_tokens
    assert d(SPEC + "num_draft_tokens_total") == ls["drafted"]
    assert d(SPEC + "num_accepted_tokens_total") == ls["accepted"]
    assert d("localspec:time_to_first_token_seconds_count") == 1
    assert d("localspec:inter_token_latency_seconds_count") == r.usage.completion_tokens - 1
    per_pos = sum(d(SPEC + "num_accepted_tokens_per_pos_total", position=str(p)) for p in range(8))
    assert per_pos == ls["accepted"]
    assert ls["drafted"] > 0  # the tiny pair drafts with method draft, so the speculation counters did move
    assert d(SPEC + "num_drafts_total") > 0


def test_a_rejected_request_is_counted(open_api):
    before = scrape(open_api)
    status, _, _ = open_api.raw("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "temperature": 9}')
    assert status == 400  # a bad request never reaches the queue: no outcome counted
    c = open_api.client(max_retries=0)
    c.completions.create(model="x", prompt="hi", max_tokens=2)
    after = scrape(open_api)
    assert v(after, "localspec:requests_total", outcome="completed") - \
        v(before, "localspec:requests_total", outcome="completed") == 1
    assert v(after, "localspec:requests_total", outcome="failed") == v(before, "localspec:requests_total",
                                                                         outcome="failed")


def test_a_finished_request_is_counted_before_its_client_hears_of_it(open_api, monkeypatch):
    """A client that reads /metrics or /health right after its answer sees the answer counted."""
    from localspec.core.engine import Finished
    from localspec.server.queue import Job

    worker, seen, post = open_api.app.state.worker, [], Job.post

    def spy(job, item):
        if isinstance(item, Finished):
            seen.append((worker.counts["completed"], v(scrape(open_api), "localspec:requests_total",
                                                       outcome="completed")))
        post(job, item)

    before = worker.counts["completed"], v(scrape(open_api), "localspec:requests_total", outcome="completed")
    monkeypatch.setattr(Job, "post", spy)
    open_api.client(max_retries=0).completions.create(model="x", prompt="hi", max_tokens=2)
    assert seen == [(before[0] + 1, before[1] + 1)]


def counted_as_client_error(api, before, health) -> None:
    """Since `before` (a scrape) and `health` (/health's generations), one request counted as client_error and none
    as failed, in requests_total and in /health."""
    after, health2 = scrape(api), api.health()["generations"]

    def d(outcome):
        return v(after, "localspec:requests_total", outcome=outcome) - \
            v(before, "localspec:requests_total", outcome=outcome)

    assert d("failed") == 0 and d("client_error") == 1
    assert health2["failed"] == health["failed"] and health2["client_error"] == health.get("client_error", 0) + 1


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "x " * 9000, "max_tokens": 2}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 9000}],
                                                                 "max_tokens": 2})])
def test_a_prompt_longer_than_the_context_is_a_client_error_not_a_failure(open_api, path, body):
    """A 400 the client caused must not fire alerts on failed generations: /health and requests_total count it as
    client_error."""
    import json

    before, health = scrape(open_api), open_api.health()["generations"]
    status, _, err = open_api.raw("POST", path, json.dumps(body))
    assert status == 400 and err["error"]["code"] == "context_length_exceeded", err
    assert "8192" in err["error"]["message"] and "context size" in err["error"]["message"]
    counted_as_client_error(open_api, before, health)


@pytest.mark.parametrize("stream", [False, True])
def test_a_bias_banning_every_token_is_a_client_error_not_a_failure(open_api, stream):
    """A request refused for what it asked, found only as its generation starts (a logit_bias that leaves no token),
    is the client's error: /health and requests_total count it as client_error, not as a failed generation."""
    import json

    ban = {str(t): -100 for t in range(open_api.session.engine.target.n_vocab)}
    before, health = scrape(open_api), open_api.health()["generations"]
    status, _, err = open_api.raw("POST", "/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logit_bias": ban, "stream": stream}))
    assert status == 400 and err["error"]["param"] == "logit_bias", err
    counted_as_client_error(open_api, before, health)


def test_every_outcome_shows_from_the_start(session):
    from localspec.server.config import ServerConfig

    with serving(session, ServerConfig()) as s:
        m = scrape(s)
        for o in ("completed", "cancelled", "failed", "rejected", "client_error"):
            assert ("localspec:requests_total", frozenset({("outcome", o)})) in m, o
        assert s.health()["generations"] == {o: 0 for o in ("completed", "cancelled", "failed", "rejected",
                                                             "client_error")}


def test_no_metrics_turns_the_route_off_and_the_key_guards_it(session):
    from localspec.server.config import ServerConfig

    with serving(session, ServerConfig(no_metrics=True)) as s:
        assert s.raw("GET", "/metrics")[0] == 404
    with serving(session, ServerConfig(api_key=KEY)) as s:
        assert s.raw("GET", "/metrics")[0] == 401
        assert scrape(s, Authorization=f"Bearer {KEY}")


def test_each_app_has_its_own_registry(session):
    from localspec.server.app import create_app

    a = create_app(session, log=lambda m: None)
    b = create_app(session, log=lambda m: None)
    try:
        assert a.state.metrics.registry is not b.state.metrics.registry
    finally:
        a.state.worker.stop()
        b.state.worker.stop()


def test_the_serve_command_has_no_metrics(monkeypatch):
    from typer.testing import CliRunner

    import localspec.server.main as A
    from localspec.cli.app import app

    seen = {}
    monkeypatch.setattr(A, "serve", lambda sess, **kw: seen.update(kw))
    monkeypatch.setattr("localspec.cli.serve.use_template", lambda *a: None)
    r = CliRunner().invoke(app, ["serve", "--no-metrics"])
    assert r.exit_code == 0, r.output
    assert seen["no_metrics"] is True


def test_tokens_drafted_and_accepted_are_counted_per_drafter(open_api):
    """Per request, each drafter's steps, drafted and accepted tokens land under its `drafter` label: the draft
    model's under the default method, the suffix cache's when a repeated prompt is drafted from it."""
    c = open_api.client(max_retries=0)
    by = {name: SPEC + f"num_{what}_by_drafter_total" for name, what in
          (("steps", "drafts"), ("drafted", "draft_tokens"), ("accepted", "accepted_tokens"))}
    for method, prompt in (("draft", "count to ten"), ("suffix", "def f(x): return x")):
        extra = {"localspec": {"method": method, "k": 3, "exactness": "lossless"}}
        if method == "suffix":  # the first answer joins the cache the second is drafted from
            c.completions.create(model="x", prompt=prompt, max_tokens=60, extra_body=extra)
        before = scrape(open_api)
        r = c.completions.create(model="x", prompt=prompt, max_tokens=60, extra_body=extra)
        ls = r.model_extra["localspec"]
        after = scrape(open_api)
        d = lambda name, **lb: v(after, name, **lb) - v(before, name, **lb)  # noqa: E731
        assert ls["drafted"] > 0 and set(ls["steps_by_method"]) <= {method, "none"}, ls
        assert d(by["steps"], drafter=method) == ls["steps_by_method"][method]
        assert d(by["drafted"], drafter=method) == ls["drafted"]
        assert d(by["accepted"], drafter=method) == ls["accepted"]
        others = {k[1] for k in after if k[0] in by.values()} - {frozenset({("drafter", method)})}
        assert all(d(n, **dict(lb)) == 0 for n in by.values() for lb in others)


def test_a_request_drafted_from_several_sources_counts_each_ones_share():
    from localspec.core.engine import Finished
    from localspec.core.stats import Stats
    from localspec.server.metrics import Metrics

    st = Stats()
    for n, a, src in ((4, 4, "suffix"), (3, 1, "lookup"), (0, 0, ""), (4, 2, "suffix")):
        st.record_step(n, a, src)
        st.method_used[src or "none"] += 1
    m = Metrics("tiny")
    m.request_done(Finished("", [], "stop", st))
    got = {(s.name, s.labels["drafter"]): s.value for f in parser.text_string_to_metric_families(m.render().decode())
           for s in f.samples if "drafter" in s.labels and s.name.endswith("_total")}
    assert got == {(SPEC + "num_drafts_by_drafter_total", "suffix"): 2,
                   (SPEC + "num_drafts_by_drafter_total", "lookup"): 1,
                   (SPEC + "num_draft_tokens_by_drafter_total", "suffix"): 8,
                   (SPEC + "num_draft_tokens_by_drafter_total", "lookup"): 3,
                   (SPEC + "num_accepted_tokens_by_drafter_total", "suffix"): 6,
                   (SPEC + "num_accepted_tokens_by_drafter_total", "lookup"): 1}
