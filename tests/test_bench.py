"""bench and tune: report arithmetic, schema, exactness detection, tune storing its choice."""

import csv
import json
import os
import subprocess
import sys

import pytest

from localspec import bench as B
from localspec.engine import Engine


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
    assert allr["exact"] is False and allr["mismatches"] == [{"prompt": "chat-x", "repeat": 0, "position": 7, "margin": 0.3}]
    assert allr["speedup_median"] == 1.0 and allr["runs"] == 3
    assert by[("none", "all")]["speedup_median"] is None
    assert "lookup k=2" in B.bars([r for r in rows if r["method"] != "none"])


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
    import localspec.engine as eng

    e = Engine.load(target_path, draft_path, n_ctx=1024)
    try:
        ps = [{"id": "p1", "category": "code", "prompt": "the cat and the dog"}]
        cfg = B.BenchConfig("draft", 2, p_min=0.0)
        ok = B.run_bench(e, ps, [cfg], max_tokens=40)
        assert all(r.exact for r in ok if r.method != "none")
        monkeypatch.setattr(eng, "greedy_verify", lambda d, am: (len(d), int(am[len(d)])))
        bad = B.run_bench(e, ps, [cfg], max_tokens=40)
        broken = [r for r in bad if r.method == "draft"][0]
        assert broken.exact is False and broken.mismatch_pos is not None and broken.mismatch_margin > 0
        rows = B.summarize(bad)
        assert any(r["exact"] is False for r in rows)
    finally:
        e.close()


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
    tuned = shown["tuned"][target_path.name]
    assert tuned["method"] in ("none", "lookup") and tuned["k"] in (0, 1, 2) and tuned["tokens_per_second"] > 0
    r = subprocess.run([sys.executable, "-m", "localspec", "run", "-m", str(target_path), "-n", "4", "--json", "--raw", "hi"],
                       capture_output=True, env=env, timeout=60)
    d = json.loads(r.stdout)
    assert d["requested_method"] == tuned["method"] or tuned["method"] == "auto"
    if tuned["method"] != "none":
        assert d["draft_tokens"] == tuned["k"]
