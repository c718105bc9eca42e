"""bench and tune: report arithmetic, schema, exactness detection, tune storing its choice."""

import csv
import json
import os
import subprocess
import sys

import pytest

from localspec.bench import runner as B
from localspec.cli.bench_report import bars, print_report
from localspec.core.engine import Engine


def rr(config, method, k, cat, tps, speedup=None, exact=None, drafted=0, accepted=0, passes=10, lat=1.0):
    return B.RunResult(prompt_id=f"{cat}-x", category=cat, config=config, method=method, k=k, repeat=0,
                       tokens_per_second=tps, latency_s=lat, ttft_s=0.1, completion_tokens=20, drafted=drafted,
                       accepted=accepted, acceptance_rate=accepted / drafted if drafted else 0.0,
                       mean_accepted_length=1.0, draft_s=0.0, verify_s=1.0, target_passes=passes, k_effective=k,
                       speedup=speedup, exact=exact)


def test_percentile_and_ideal_speedup():
    assert B.percentile([1, 2, 3, 4], 50) == 2.5
    assert abs(B.percentile(list(range(1, 101)), 95) - 95.05) < 1e-9
    # alpha 0.8, k 3, free drafts, verify of 4 costs 2x: (1 - 0.8^4) / (0.2 * 2)
    assert abs(B.ideal_speedup(0.8, 3, 0.0, 2.0) - (1 - 0.8 ** 4) / 0.2 / 2.0) < 1e-12
    assert B.ideal_speedup(1.0, 4, 0.0, 1.0) == 5.0
    assert B.ideal_speedup(0.5, 0, 0.3, 1.0) == 1.0


def test_summarize_medians_ratios_and_exactness():
    results = [
        rr("none", "none", 0, "code", 10.0), rr("lookup k=2", "lookup", 2, "code", 15.0, 1.5, True, 20, 10),
        rr("none", "none", 0, "code", 12.0), rr("lookup k=2", "lookup", 2, "code", 12.0, 1.0, True, 20, 10),
        rr("none", "none", 0, "chat", 10.0), rr("lookup k=2", "lookup", 2, "chat", 8.0, 0.8, False, 10, 2),
    ]
    results[-1].mismatch_pos, results[-1].mismatch_margin = 7, 0.3
    calib = {"ratio": {1: 1.0, 2: 1.5, 3: 2.0}, "c": 0.4}
    rows = B.summarize(results, calib)
    by = {(r["config"], r["category"]): r for r in rows}
    code = by[("lookup k=2", "code")]
    assert code["speedup_median"] == 1.25 and code["tps_median"] == 13.5 and code["exact"] is True
    assert code["acceptance_rate"] == 0.5 and code["mean_accepted_length"] == (20 + 20) / 20
    assert abs(code["ideal_speedup"] - B.ideal_speedup(0.5, 2, 0.0, 2.0)) < 1e-12
    assert abs(code["measured_over_ideal"] - 1.25 / code["ideal_speedup"]) < 1e-12
    allr = by[("lookup k=2", "all")]
    assert allr["exact"] is False and allr["mismatches"] == [{"prompt": "chat-x", "repeat": 0, "position": 7, "margin": 0.3,
                                                             "deviation": None, "kind": None}]
    assert allr["identical_share"] == 2 / 3 and allr["median_divergence"] == 7
    assert allr["speedup_median"] == 1.0 and allr["runs"] == 3
    assert by[("none", "all")]["speedup_median"] is None
    assert "lookup k=2" in bars([r for r in rows if r["method"] != "none"])


def test_parse_configs_and_prompts(tmp_path):
    cfgs = B.parse_configs("none,draft,lookup,auto", "2,4", has_draft=True)
    assert [c.label for c in cfgs] == ["draft k=2", "draft k=4", "lookup k=2", "lookup k=4", "auto k<=4"]
    assert [c.label for c in B.parse_configs("draft,lookup", "2", has_draft=False)] == ["lookup k=2"]
    from localspec.errors import UsageError

    with pytest.raises(UsageError):
        B.parse_configs("fast", "2")
    with pytest.raises(UsageError):
        B.parse_configs("lookup", "0")
    ps = B.load_prompts()
    assert len(ps) >= 30 and {p["category"] for p in ps} == set(B.CATEGORIES)
    assert len(B.load_prompts(limit=1)) == 6
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"id": "a", "prompt": "x"}\nnot json\n')
    with pytest.raises(UsageError, match="line 2"):
        B.load_prompts(bad)


def test_run_bench_flags_a_broken_config(target_path, draft_path, monkeypatch):
    """A deliberately broken verifier (accepts every draft) must show up as a mismatch with its position."""
    import localspec.core.generation as eng

    e = Engine.load(target_path, draft_path, n_ctx=1024)
    try:
        ps = [{"id": "p1", "category": "code", "prompt": "the cat and the dog"}]
        cfg = B.BenchConfig("draft", 2, p_min=0.0)
        ok = B.run_bench(e, ps, [cfg], max_tokens=40, exactness="bit")
        assert all(r.exact for r in ok if r.method != "none")
        assert {r.exactness for r in ok if r.method != "none"} == {"bit"}
        monkeypatch.setattr(eng, "greedy_verify", lambda d, am: (len(d), int(am[len(d)])))
        for level in ("bit", "lossless"):
            bad = B.run_bench(e, ps, [cfg], max_tokens=40, exactness=level)
            broken = [r for r in bad if r.method == "draft"][0]
            assert broken.exact is False and broken.mismatch_pos is not None and broken.mismatch_margin > 0
            assert broken.exactness == level and broken.mismatch_deviation is not None
            assert broken.mismatch_margin > 2 * broken.mismatch_deviation and broken.mismatch_kind == "bug"
            rows = B.summarize(bad)
            row = next(r for r in rows if r["config"] == cfg.label and r["category"] == "all")
            assert row["exact"] is False and row["bugs"] == 1 and row["identical_share"] == 0.0
            assert row["median_divergence"] == broken.mismatch_pos and row["exactness"] == level
    finally:
        e.close()


def test_each_bench_run_drafts_as_a_lone_request_and_leaves_the_suffix_cache_alone(target_path, tmp_path,
                                                                                    monkeypatch):
    """A bench run's suffix drafter sees its own request only: not the on-disk cache of earlier sessions, not the
    answer of another configuration or an earlier repeat of the same prompt; and bench writes no cache file."""
    from localspec.core.engine import GenConfig
    from localspec.drafters import suffix_corpus as CO
    from localspec.store import suffixcache as SC

    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LOCALSPEC_CONFIG_DIR", str(tmp_path / "cfg"))
    CO._CORPORA.clear()
    e = Engine.load(target_path, n_ctx=1024)
    try:
        p = {"id": "p1", "category": "code", "prompt": "Hello world, the x = y + 1"}
        prompt = e.chat_prompt([{"role": "user", "content": p["prompt"]}])
        configs = [B.BenchConfig("suffix", 8), B.BenchConfig("suffix", 4)]
        alone = {}
        monkeypatch.setenv("LOCALSPEC_SUFFIX_CACHE", "false")
        for c in configs:  # each configuration as a lone request on an empty cache
            CO._CORPORA.clear()
            fin = e.complete(prompt, GenConfig(method="suffix", k=c.k, max_tokens=60, exactness="lossless"))
            alone[c.label] = fin.stats.accepted
        monkeypatch.delenv("LOCALSPEC_SUFFIX_CACHE")
        CO._CORPORA.clear()
        # an earlier session's cache holds this very answer
        plain = e.complete(prompt, GenConfig(method="none", max_tokens=60))
        fp = SC.model_fingerprint(e.target)
        assert SC.SuffixFile(fp).save([CO.Doc("earlier", 1.0, prompt + plain.tokens)])
        before = SC.path_for(fp).read_bytes()
        res = B.run_bench(e, [p], configs, max_tokens=60, repeat=2, exactness="lossless")
        assert all(scope == "" for _, scope in CO._CORPORA)  # the runs' own corpora are gone with them
        CO._AT_EXIT.run()  # what a process ending now would save
    finally:
        e.close()
        CO._CORPORA.clear()
    runs = [r for r in res if r.method == "suffix"]
    assert len(runs) == 4 and all(r.exact for r in runs)
    assert [r.accepted for r in runs] == [alone[r.config] for r in runs]
    assert all(r.accepted < 0.8 * r.completion_tokens for r in runs)  # the repeated answer was not drafted
    assert [f.name for f in SC.folder().iterdir()] == [SC.path_for(fp).name]
    assert SC.path_for(fp).read_bytes() == before


def test_steps_recorded_with_their_source_give_each_sources_drafts_and_acceptance():
    from localspec.core.stats import Stats

    st = Stats()
    for n, a, src in ((4, 4, "suffix"), (4, 1, "lookup"), (0, 0, ""), (3, 3, "suffix")):
        st.record_step(n, a, src)
        st.method_used[src or "none"] += 1
    assert st.by_source() == {"suffix": (2, 7, 7), "lookup": (1, 4, 1)}
    one = Stats()
    one.record_step(5, 2)
    one.method_used["draft"] += 1
    assert one.by_source() == {"draft": (1, 5, 2)}  # one source drafted every step: all of it is its own
    two = Stats()
    for src in ("draft", "lookup"):
        two.record_step(5, 2)
        two.method_used[src] += 1
    assert two.by_source() == {"draft": (1, None, None), "lookup": (1, None, None)}  # no split recorded: unknown


def test_bench_summary_adds_up_each_drafting_source():
    a = rr("auto k<=4", "auto", 4, "code", 12.0, 1.2, True, 12, 8)
    a.sources = {"suffix": {"steps": 2, "drafted": 8, "accepted": 7}, "lookup": {"steps": 1, "drafted": 4,
                                                                                "accepted": 1}}
    b = rr("auto k<=4", "auto", 4, "chat", 12.0, 1.2, True, 8, 2)
    b.sources = {"lookup": {"steps": 2, "drafted": 8, "accepted": 2}, "draft": {"steps": 1, "drafted": None,
                                                                               "accepted": None}}
    by = {(r["config"], r["category"]): r for r in B.summarize([a, b])}
    assert by[("auto k<=4", "all")]["sources"] == {
        "suffix": {"steps": 2, "drafted": 8, "accepted": 7, "acceptance_rate": 7 / 8},
        "lookup": {"steps": 3, "drafted": 12, "accepted": 3, "acceptance_rate": 0.25},
        "draft": {"steps": 1, "drafted": None, "accepted": None, "acceptance_rate": None}}
    assert set(by[("auto k<=4", "code")]["sources"]) == {"suffix", "lookup"}
    import io

    from rich.console import Console

    buf = io.StringIO()
    print_report(B.summarize([rr("none", "none", 0, "code", 10.0), a, b]), Console(file=buf, width=100))
    out = buf.getvalue()
    assert "drafting sources" in out
    line = next(x for x in out.splitlines() if "suffix" in x and "auto k<=4" in x)
    assert line.split()[-4:] == ["2", "8", "7", "88%"]


def test_bench_measures_the_suffix_method_and_shows_which_source_drafted(target_path, tmp_path, monkeypatch, capsys):
    import io

    from localspec.cli.app import main

    monkeypatch.setenv("LOCALSPEC_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    prompts, out_j, out_c = tmp_path / "p.jsonl", tmp_path / "b.json", tmp_path / "b.csv"
    prompts.write_text(json.dumps({"id": "a", "category": "code", "prompt": "def f(x): return x"}) + "\n")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "-m", str(target_path), "--prompts", str(prompts), "--methods", "none,suffix,lookup", "--k",
              "4", "-n", "150", "--exactness", "lossless", "--json", str(out_j), "--csv", str(out_c)])
    assert exc.value.code == 0
    by = {s["config"]: s for s in json.loads(out_j.read_text())["summary"] if s["category"] == "all"}
    assert set(by) == {"none", "suffix k=4", "lookup k=4"} and by["suffix k=4"]["exact"] is True
    for method in ("suffix", "lookup"):
        row = by[f"{method} k=4"]
        src = row["sources"][method]
        assert set(row["sources"]) == {method} and src["drafted"] == src["accepted"] > 0
        assert src["acceptance_rate"] == row["acceptance_rate"] == 1.0 and src["steps"] > 0
    assert by["none"]["sources"] == {}
    rows = list(csv.DictReader(out_c.open()))
    assert json.loads(next(r for r in rows if r["method"] == "suffix")["sources"])["suffix"]["drafted"] > 0
    out = capsys.readouterr().out
    assert "suffix k=4" in out and "drafting sources" in out


def test_bench_cli_json_csv(target_path, tmp_path):
    env = {**os.environ, "LOCALSPEC_CONFIG_DIR": str(tmp_path / "cfg"), "HF_HUB_OFFLINE": "1"}
    out_j, out_c = tmp_path / "b.json", tmp_path / "b.csv"
    r = subprocess.run([sys.executable, "-m", "localspec", "bench", "-m", str(target_path), "-d", str(target_path),
                        "--limit", "1", "--categories", "code,chat", "-n", "16", "--k", "2", "--methods", "none,draft,lookup,auto",
                        "--json", str(out_j), "--csv", str(out_c)], capture_output=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads(out_j.read_text())
    assert {"meta", "calibration", "summary", "runs"} <= set(data)
    configs = {s["config"] for s in data["summary"]}
    assert configs == {"none", "draft k=2", "lookup k=2", "auto k<=2"}
    assert all(s["exact"] in (True, None) for s in data["summary"])
    rows = list(csv.DictReader(out_c.open()))
    assert len(rows) == 2 * 2 * 3 and {"tokens_per_second", "speedup", "exact"} <= set(rows[0])
    assert b"speedup" in r.stdout
    # never overwrite without asking
    r = subprocess.run([sys.executable, "-m", "localspec", "bench", "-m", str(target_path), "--json", str(out_j)],
                       capture_output=True, env=env, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and b"refusing to overwrite" in r.stderr


def test_tune_stores_choice_and_run_uses_it(target_path, tmp_path):
    env = {**os.environ, "LOCALSPEC_CONFIG_DIR": str(tmp_path / "cfg"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "localspec", "tune", "-m", str(target_path), "--k", "1,2", "-n", "16", "--limit", "1"],
                       capture_output=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    err = r.stderr.decode()
    assert "chose" in err or "does not pay" in err
    shown = json.loads(subprocess.run([sys.executable, "-m", "localspec", "config", "--json"], capture_output=True, env=env).stdout)
    assert target_path.name not in shown["tuned"]  # keyed by the file itself, not by its name
    (key, tuned), = shown["tuned"].items()
    assert key.startswith(str(target_path.resolve()))
    assert tuned["method"] in ("none", "lookup") and tuned["k"] in (0, 1, 2) and tuned["tokens_per_second"] > 0
    r = subprocess.run([sys.executable, "-m", "localspec", "run", "-m", str(target_path), "-n", "4", "--json", "--raw", "hi"],
                       capture_output=True, env=env, timeout=60)
    d = json.loads(r.stdout)
    assert d["requested_method"] == tuned["method"] or tuned["method"] == "auto"
    if tuned["method"] != "none":
        assert d["draft_tokens"] == tuned["k"]
    # another model of the same file name in another folder is not the tuned one
    from tinymodels import write_model

    (tmp_path / "elsewhere").mkdir()
    other = write_model(tmp_path / "elsewhere" / target_path.name, 99)
    r = subprocess.run([sys.executable, "-m", "localspec", "config", "-m", str(other), "--json"], capture_output=True,
                       env=env)
    assert json.loads(r.stdout)["settings"]["method"] == {"value": "auto", "source": "default"}
    r = subprocess.run([sys.executable, "-m", "localspec", "config", "-m", str(target_path), "--json"],
                       capture_output=True, env=env)
    assert json.loads(r.stdout)["settings"]["method"]["source"].startswith("tune")


def test_audit_calls_a_real_near_tie_flip_numeric(tmp_path, monkeypatch):
    """Lossless verification with big batches really flips near-ties: f16 KV past 512 cells makes llama.cpp's CPU
    attention sum a one-token decode in another order than a batch (logits move by ~0.01), and a model without the
    fixtures' wide margins has near-ties. The audit finds such a flip and calls it numeric, not a bug."""
    from tinymodels import write_model

    monkeypatch.setenv("LOCALSPEC_KV_TYPE", "f16")
    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "cache"))
    text = " ".join(["the cat and the dog x = y + 1"] * 22)  # about 550 tokens: past 512 KV cells
    found = []
    for seed in range(1, 13):
        e = Engine.load(write_model(tmp_path / f"m{seed}.gguf", seed, bigram=0.0), None, n_ctx=1024)
        try:
            res = B.run_bench(e, [{"id": "long", "category": "code", "prompt": text}], [B.BenchConfig("lookup", 8)],
                              max_tokens=120, exactness="lossless")
        finally:
            e.close()
        found += [r for r in res if r.exact is False]
        if found:
            break
    assert found, "no near-tie flipped in 12 models: the audit was not exercised"
    for r in found:
        assert r.exactness == "lossless" and r.mismatch_deviation > 0
        assert 0 <= r.mismatch_margin <= 2 * r.mismatch_deviation and r.mismatch_kind == "numeric"
    row = next(x for x in B.summarize(res) if x["method"] == "lookup" and x["category"] == "all")
    assert row["bugs"] == 0 and row["mismatches"][0]["kind"] == "numeric"


def test_bench_exits_3_on_an_algorithm_bug(target_path, draft_path, tmp_path, monkeypatch, capsys):
    import io

    import localspec.core.generation as eng
    from localspec.cli.app import main

    monkeypatch.setenv("LOCALSPEC_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    monkeypatch.setattr(eng, "greedy_verify", lambda d, am: (len(d), int(am[len(d)])))  # accepts every draft
    out_j = tmp_path / "b.json"
    with pytest.raises(SystemExit) as exc:
        main(["bench", "-m", str(target_path), "-d", str(draft_path), "--methods", "none,draft", "--k", "2", "--limit", "1",
              "--categories", "code,chat", "-n", "24", "--exactness", "bit", "--json", str(out_j)])
    err = capsys.readouterr().err
    assert exc.value.code == 3, err
    assert err.strip().splitlines()[-1] == "error: 2 divergences exceed the measured numeric deviation (algorithm bug)"
    data = json.loads(out_j.read_text())  # the report is written before the exit
    row = next(s for s in data["summary"] if s["config"] == "draft k=2" and s["category"] == "all")
    assert row["bugs"] == 2 and row["exactness"] == "bit" and {m["kind"] for m in row["mismatches"]} == {"bug"}


def test_report_into_a_pipe_keeps_every_cell():
    """`localspec bench > file`: a report written into a pipe or file keeps every cell whole (no "co…", "15…"),
    whatever width the console guesses."""
    import io

    from rich.console import Console

    results = [rr("none", "none", 0, "code_edit", 15.123), rr("lookup k=8", "lookup", 8, "code_edit", 19.987, 1.3216, True, 20, 10)]
    buf = io.StringIO()
    print_report(B.summarize(results), Console(file=buf, width=80))
    out = buf.getvalue()
    assert "…" not in out and "code_edit" in out and "lookup k=8" in out and "1.32x" in out and "20.0" in out and "15.1" in out
    assert "\x1b[" not in out and "[red]" not in out


def test_auto_rows_get_the_leviathan_bound_with_the_draft_cost_of_its_mix():
    """auto rows get a Leviathan bound ("ideal", not "-"): the standards quote measured speedup against it. It is the
    best k up to auto's cap, with the draft cost of its mix of drafters, and never below plain decoding."""
    a = rr("auto k<=4", "auto", 4, "code", 12.0, 1.2, True, 40, 20)
    a.k_effective, a.drafting_steps, a.draft_model_steps = 2, 10, 5  # half the drafting steps used the draft model
    rows = B.summarize([rr("none", "none", 0, "code", 10.0), a], {"ratio": {1: 1.0, 2: 1.5, 3: 2.0}, "c": 0.4})
    auto = next(r for r in rows if r["config"] == "auto k<=4" and r["category"] == "code")
    # the best k up to its cap (auto chooses k per step), and never below plain decoding (auto may stay plain)
    best = max(1.0, B.ideal_speedup(0.5, 1, 0.2, 1.5), B.ideal_speedup(0.5, 2, 0.2, 2.0))
    assert auto["ideal_speedup"] == pytest.approx(best)
    assert auto["measured_over_ideal"] == pytest.approx(1.2 / best)
    a.accepted = a.drafted = 40  # every draft accepted: k = 2 is the best k
    rows = B.summarize([rr("none", "none", 0, "code", 10.0), a], {"ratio": {1: 1.0, 2: 1.5, 3: 2.0}, "c": 0.4})
    auto = next(r for r in rows if r["config"] == "auto k<=4" and r["category"] == "code")
    assert auto["ideal_speedup"] == pytest.approx(B.ideal_speedup(1.0, 2, 0.2, 2.0))


def test_auto_rows_are_compared_with_the_best_fixed_setting_of_the_same_run():
    """bench reports, per category, auto against the best fixed configuration it measured (the "oracle"); plain
    decoding (1.0x) is the oracle where no fixed setting beat it."""
    results = [rr("none", "none", 0, "code", 10.0), rr("lookup k=2", "lookup", 2, "code", 13.0, 1.3, True, 20, 10),
               rr("lookup k=4", "lookup", 4, "code", 15.0, 1.5, True, 20, 10),
               rr("auto k<=4", "auto", 4, "code", 14.0, 1.4, True, 20, 10),
               rr("none", "none", 0, "chat", 10.0), rr("lookup k=2", "lookup", 2, "chat", 9.0, 0.9, True, 20, 2),
               rr("lookup k=4", "lookup", 4, "chat", 8.0, 0.8, True, 20, 2),
               rr("auto k<=4", "auto", 4, "chat", 9.9, 0.99, True, 20, 2)]
    by = {(r["config"], r["category"]): r for r in B.summarize(results)}
    code, chat = by[("auto k<=4", "code")], by[("auto k<=4", "chat")]
    assert (code["oracle"], code["oracle_speedup"]) == ("lookup k=4", 1.5)
    assert code["auto_over_oracle"] == pytest.approx(1.4 / 1.5)
    assert (chat["oracle"], chat["oracle_speedup"], chat["auto_over_oracle"]) == ("none", 1.0, pytest.approx(0.99))
    assert by[("lookup k=4", "code")]["oracle"] is None  # only auto rows are compared


def test_a_stored_tune_result_applies_only_with_the_draft_it_was_measured_with(tmp_path, monkeypatch):
    """The entry names the draft it was tuned with; a draft the user names is never dropped for lookup or none."""
    from localspec import settings as config
    from localspec.session import resolve_settings, tuned_draft, tuned_key

    monkeypatch.setenv("LOCALSPEC_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.delenv("LOCALSPEC_METHOD", raising=False)
    monkeypatch.delenv("LOCALSPEC_DRAFT", raising=False)
    target, d1, d2 = (tmp_path / n for n in ("t.gguf", "d1.gguf", "d2.gguf"))
    for f in (target, d1, d2):
        f.write_bytes(f.name.encode())

    def store(**entry):
        config.update_file(config.config_file(), lambda d: d.setdefault("tuned", {}).__setitem__(
            tuned_key(str(target), None), {"tuned_at": "x", **entry}))

    def method(draft=None):
        s = resolve_settings({"model": str(target), "draft": draft and str(draft)})
        return s["method"].value, s["draft_tokens"].value

    store(method="draft", k=3, draft=tuned_draft(str(d1)))
    assert method(d1) == ("draft", 3)
    assert method(d2) == ("auto", None) and method() == ("auto", None)  # measured with d1 only
    assert method(tmp_path / "absent.gguf") == ("auto", None)
    store(method="lookup", k=2, draft=tuned_draft(str(d1)))
    assert method(d1) == ("auto", None)  # the named draft stays in use
    store(method="none", k=0)
    assert method() == ("none", 0) and method(d1) == ("auto", None)
    d1.write_bytes(b"rewritten, longer than before")  # another file now: the result is not for it
    store(method="draft", k=3, draft=tuned_draft(str(d2)))
    target.write_bytes(b"a new target file")
    assert method(d2) == ("auto", None)


def _replay(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "localspec", "replay", *args], capture_output=True, text=True,
                          timeout=timeout)


def _one_error(r):
    assert r.returncode != 0, r.stdout
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    return lines[0]


GOOD_TRACE = [{"id": "t1", "prompt": [1, 2, 3, 4], "output": [5, 6, 5, 6, 5, 6, 5, 6]}]


@pytest.mark.parametrize("content,needle", [
    (None, "no such file"),
    ("folder", "folder"),
    (b"{not json", "JSON"),
    (b"[]", "no traces"),
    (b'{"traces": []}', "no traces"),
    (b'"a string"', "list of traces"),
    (b'[{"id": "a", "prompt": [1], "output": "xyz"}]', "output"),
    (b'[{"id": "a", "prompt": [1, "x"], "output": [1, 2]}]', "prompt"),
    (b'[{"id": "a", "prompt": [1], "output": [1]}]', "output"),
    pytest.param(b"[" * 100000, "JSON", id="nested-too-deep"),
    (b"\xff\xfe", "UTF-8"),
])
def test_replay_bad_trace_files_are_one_error_line(tmp_path, content, needle):
    f = tmp_path / "traces.json"
    if content == "folder":
        f.mkdir()
    elif content is not None:
        f.write_bytes(content)
    assert needle in _one_error(_replay(str(f)))


def test_replay_bad_token_counts_and_endless_files(tmp_path):
    f = tmp_path / "traces.json"
    f.write_text(json.dumps(GOOD_TRACE))
    for n in ("0", "1", "-3"):
        assert "--tokens" in _one_error(_replay(str(f), "--tokens", n))
    assert "--tokens" in _one_error(_replay(str(f), "--tokens", "x"))
    assert "too large" in _one_error(_replay("/dev/zero"))  # read up to a cap, not until memory runs out
    r = _replay(str(f), "--tokens", "6")
    assert r.returncode == 0 and "geomean" in r.stdout, r.stderr
