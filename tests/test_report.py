"""One report of a generation: every rendering of one `Stats` comes from core/report.py and agrees on every field
it shares with another."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from localspec.core import report
from localspec.core.engine import Finished, GenConfig
from localspec.core.stats import Stats


def sample_stats() -> Stats:
    """A generation as the engine would leave it: a fast answer (600 tok/s: under the display's 50 ms floor),
    drafting with lookup most steps, one plain step, a controller reason."""
    st = Stats(method="auto", k_cap=3, exactness="lossless", exactness_reason="lossless: chosen")
    st.prompt_tokens, st.cached_prompt_tokens = 20, 4
    st.started, st.prompt_s, st.ttft_s = 100.0, 0.0, 0.004
    for n_drafted, n_accepted in ((3, 3), (3, 1), (0, 0), (2, 0)):
        st.record_step(n_drafted, n_accepted)
        st.method_used["lookup" if n_drafted else "none"] += 1
        st.k_used[n_drafted] += 1
    for i in range(12):
        st.token_emitted(now=100.0 + 0.0016 * i)
    st.elapsed_s, st.draft_s, st.verify_s = 0.02, 0.001, 0.015
    st.reason = "auto -> lookup k=3"
    return st


def renderings(st: Stats) -> dict[str, dict]:
    cfg = GenConfig(method="auto", k=4)
    engine = SimpleNamespace(target=SimpleNamespace(name="t.gguf"), draft=None, dropped_draft=None)
    fin = Finished("hello", [1] * st.completion_tokens, "stop", st)
    return {
        "run_json": report.run_json(fin, st, engine, cfg),
        "server": report.server_object(st, cfg),
        "usage": report.openai_usage(st),
        "history": report.history_record(st),
        "bench": report.bench_figures(st),
    }


def test_the_renderings_agree_on_every_shared_field():
    st = sample_stats()
    r = renderings(st)
    for (a, da), (b, db) in itertools.combinations(r.items(), 2):
        for key in set(da) & set(db):
            assert da[key] == db[key], f"{key}: {a} says {da[key]!r}, {b} says {db[key]!r}"
    shared = set.union(*(set(d) for d in r.values()))
    assert {"completion_tokens", "tokens_per_second", "method", "acceptance_rate"} <= shared
    # the figures are the measured ones: a fast answer has a rate, what produced the tokens is lookup (not "auto")
    assert r["history"]["tokens_per_second"] == pytest.approx(12 / 0.02) and r["history"]["method"] == "lookup"


def test_the_text_renderings_use_the_same_figures():
    st = sample_stats()
    st.elapsed_s = 1.2  # a rate the display shows (over its 50 ms floor)
    rate = report.rate_text(st.rate())
    assert rate != "—"
    for line in (report.live_line(st), report.short_summary(st, "stop"), report.summary_line(st, "stop"),
                 report.answer_note(st)):
        assert rate in line and str(st.completion_tokens) in line
    assert f"{st.acceptance_rate:.0%}" in report.short_summary(st, "stop")


def test_the_agreement_check_catches_a_disagreement():
    """The check above, fed a rendering that disagrees (a history that stores the requested method "auto" and
    the display's rate, which is None under 50 ms), fails."""
    st = sample_stats()
    r = renderings(st)
    r["history"] = {**r["history"], "method": st.method, "tokens_per_second": st.rate()}
    bad = [k for (_, da), (_, db) in itertools.combinations(r.items(), 2) for k in set(da) & set(db) if da[k] != db[k]]
    assert "method" in bad and "tokens_per_second" in bad


def test_an_answer_interrupted_before_its_first_step_still_renders():
    cfg = GenConfig()
    engine = SimpleNamespace(target=SimpleNamespace(name="t.gguf"), draft=None, dropped_draft=None)
    d = report.run_json(None, None, engine, cfg, interrupted=True, text="par")
    assert d["text"] == "par" and d["finish_reason"] == "interrupted" and d["completion_tokens"] == 0


def test_the_front_ends_render_through_the_report():
    """The server's usage and localspec objects and the chat's history record and answer line are the report's."""
    from localspec.cli import render
    from localspec.server import openai
    from localspec.tui import notes

    st = sample_stats()
    cfg = GenConfig(method="auto", k=4)
    assert openai.localspec_stats(st, cfg) == report.server_object(st, cfg)
    assert openai.usage(st) == report.openai_usage(st)
    assert notes.stats_record(st) == report.history_record(st)
    assert notes.answer_note(st) == report.answer_note(st)
    engine = SimpleNamespace(target=SimpleNamespace(name="t.gguf"), draft=None, dropped_draft=None)
    assert render.result_json(None, st, engine, cfg, text="x") == report.run_json(None, st, engine, cfg, text="x")
    assert render.summary_line(st, "stop") == report.summary_line(st, "stop")


def test_the_recent_rate_reads_while_the_generation_thread_appends():
    """The TUI's timer reads recent_rate() while the engine's thread emits tokens: it never iterates the live deque
    (that raises "deque mutated during iteration")."""
    import sys
    import threading
    import time

    from localspec.core.stats import Stats

    st = Stats()
    st.started, st.running = time.perf_counter(), True
    stop = threading.Event()

    def emit():
        while not stop.is_set():
            st.token_emitted()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=emit)
    t.start()
    try:
        for _ in range(3000):
            st.recent_rate()
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
