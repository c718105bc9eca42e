"""The session layer: settings precedence with sources, tune results vs explicit choices, live figures, files
shared by concurrent processes, parallel generations, and output that survives pipes."""

import ast
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from fakehub import FakeHub
from helpers import cli
from localspec import settings as config
from localspec.core.stats import Stats
from localspec.session import Session, generation_slot, resolve_settings, tuned_key

pytestmark = pytest.mark.usefixtures("isolated_config")  # config, cache and env isolated per test

PKG = Path(__file__).resolve().parents[1] / "localspec"


def store_tuned(key, **entry):
    config.update_file(config.config_file(), lambda d: d.setdefault("tuned", {}).__setitem__(key, entry))


# ------------------------------------------------------------------ precedence
def test_precedence_flag_env_file_tune_pair_default(monkeypatch):
    s = resolve_settings({})
    assert s["draft_tokens"].source.startswith("pair ") and s["ctx_size"].source.startswith("pair ")
    assert s["p_min"].source == "default"
    store_tuned("qwen2.5-coder-1.5b", method="lookup", k=3, p_min=0.6, tuned_at="x")
    s = resolve_settings({})
    assert (s["method"].value, s["draft_tokens"].value, s["p_min"].value) == ("lookup", 3, 0.6)
    assert s["method"].source.startswith("tune")
    config.update_file(config.config_file(), lambda d: d.__setitem__("method", "draft"))
    s = resolve_settings({})
    assert s["method"].value == "draft" and s["method"].source.startswith("file ")
    assert s["draft_tokens"].value == 3  # tune still fills what the file does not set
    monkeypatch.setenv("LOCALSPEC_METHOD", "none")
    assert resolve_settings({})["method"].source == "env LOCALSPEC_METHOD"
    s = resolve_settings({"method": "auto"})
    assert (s["method"].value, s["method"].source) == ("auto", "flag")


def test_config_command_shows_tune_and_pair_sources():
    store_tuned("qwen2.5-coder-1.5b", method="lookup", k=3, tuned_at="2026-11-30 10:00")
    r = cli(["config", "--json"])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)["settings"]
    assert d["method"] == {"value": "lookup", "source": "tune (2026-11-30 10:00)"}
    assert d["ctx_size"]["source"] == "pair qwen2.5-coder-1.5b"


def test_explicit_flags_beat_stored_tune_results(target_path):
    """Explicit flags beat a stored tune result: `run --method auto --p-min 0.3` runs with auto and 0.3."""
    store_tuned(tuned_key(str(target_path), None), method="lookup", k=1, p_min=0.9, tuned_at="x")
    r = cli(["run", "-m", str(target_path), "--method", "auto", "-k", "3", "-n", "6", "--json", "--raw", "hello"])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["requested_method"] == "auto" and d["draft_tokens"] == 3
    r = cli(["run", "-m", str(target_path), "-n", "6", "--json", "--raw", "hello"])
    d = json.loads(r.stdout)
    assert d["requested_method"] == "lookup" and d["draft_tokens"] == 1  # without flags, the tune result applies
    sess = Session({"model": str(target_path), "method": "auto", "p_min": 0.3})
    assert sess.gen_config().p_min == 0.3
    assert Session({"model": str(target_path)}).gen_config().p_min == 0.9


# ------------------------------------------------------------------ chat
async def _until(pilot, cond, timeout=30.0):
    t = 0.0
    while not cond():
        await pilot.pause(0.05)
        t += 0.05
        assert t < timeout, "timed out"


def test_chat_applies_tune_results_and_k_zero(target_path):
    """The chat applies tune results, and `/k 0` means k = 0."""
    import asyncio

    from localspec.tui.app import create_app

    store_tuned(tuned_key(str(target_path), None), method="lookup", k=3, tuned_at="x")
    app = create_app({"model": str(target_path), "ctx_size": 512})

    async def go():
        async with app.run_test(size=(120, 36)) as pilot:
            await _until(pilot, lambda: app.engine is not None)
            cfg = app.gen_config()
            assert (cfg.method, cfg.k) == ("lookup", 3)
            box = app.query_one("#prompt")
            for cmd in ("/k 0", "/method draft"):
                box.load_text(cmd)
                box.focus()
                await pilot.press("enter")
            cfg = app.gen_config()
            assert (cfg.method, cfg.k) == ("draft", 0)  # the user's choice in chat wins over the tune result
            box.load_text("/temp nan")
            await pilot.press("enter")
            assert app.gen_config().sampling.temperature == 0.0  # refused, nothing changed

    asyncio.run(go())


# ------------------------------------------------------------------ live figures
def test_live_tokens_per_second_while_streaming(target_path):
    """tokens/s is live while the answer streams, not 0.0 until it ends."""
    from localspec.core.engine import Engine, GenConfig, Piece

    eng = Engine.load(target_path, None, n_ctx=512)
    try:
        seen = []
        for ev in eng.generate(eng.raw_prompt("the cat"), GenConfig(method="lookup", k=3, max_tokens=60)):
            if isinstance(ev, Piece) and eng.last_stats.completion_tokens in (10, 40):
                time.sleep(0.06)
                seen.append((eng.last_stats.tokens_per_second, eng.last_stats.rate(), eng.last_stats.recent_rate()))
        assert len(seen) == 2
        for tps, rate, recent in seen:
            assert tps > 0 and rate is not None and rate > 0 and recent is not None and recent > 0
    finally:
        eng.close()


def test_status_ticker_refreshes_without_tokens(monkeypatch):
    from localspec.cli import render as C

    writes = []

    class Tty:
        def isatty(self):
            return True

        def write(self, s):
            writes.append(s)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Tty())
    monkeypatch.setattr(sys, "stdout", Tty())
    st = Stats()
    st.started, st.running, st.completion_tokens = time.perf_counter() - 1.0, True, 20
    status = C.Status(quiet=False)
    status.INTERVAL = 0.05
    status.start(lambda: st)
    time.sleep(0.3)
    status.stop()
    lines = [w for w in writes if "tok/s" in w]
    assert len(lines) >= 3  # refreshed by the ticker alone, with no token arriving
    assert " 0.0 tok/s" not in lines[0] and "tok/s" in lines[0]


def test_rates_need_two_tokens_and_50ms():
    st = Stats(completion_tokens=1, elapsed_s=0.51)
    assert st.rate() is None
    st = Stats(completion_tokens=5, elapsed_s=0.01)
    assert st.rate() is None
    st = Stats(completion_tokens=5, elapsed_s=1.0)
    assert st.rate() == pytest.approx(5.0)


def test_two_figures_tokens_per_pass_and_mean_accepted_length():
    """"mean accepted length" counts drafting steps only (3.0 where 6 of 124 steps drafted, not 1.07); tokens per
    pass counts every step."""
    st = Stats()
    for _ in range(118):
        st.record_step(0, 0)
    for _ in range(6):
        st.record_step(3, 2)
    assert st.drafting_steps == 6
    assert st.mean_accepted_length == pytest.approx(1 + 12 / 6)
    assert st.tokens_per_pass == pytest.approx((124 + 12) / 124)


# ------------------------------------------------------------------ concurrency
def test_four_concurrent_pulls_download_once(tmp_path, monkeypatch, target_path, draft_path):
    """Four pulls at once on an empty cache all succeed, and the file is downloaded once."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        sha_t = hub.add_file("test/tiny", "target.gguf", target_path.read_bytes())
        hub.add_file("test/tiny", "draft.gguf", draft_path.read_bytes())
        assert cli(["models", "add", "tiny", "--target", "hf://test/tiny/target.gguf",
                    "--draft", "hf://test/tiny/draft.gguf"]).returncode == 0
        hub.slow = True
        env = dict(os.environ)
        procs = [subprocess.Popen([sys.executable, "-m", "localspec", "models", "pull", "tiny", "--no-check"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) for _ in range(4)]
        outs = [p.communicate(timeout=120) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, err.decode()
        assert any(b"waiting for another localspec process downloading" in err for _, err in outs)
        gets = [l for l in hub.log if l[0] == "GET" and l[1].endswith("/target.gguf") and not l[2]]  # add reads headers
        assert len(gets) == 1, gets  # downloaded once, the others used the verified file
        snap = next((tmp_path / "hf").rglob("snapshots/*/target.gguf"))
        assert hashlib_sha(snap) == sha_t


def hashlib_sha(p):
    import hashlib

    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_memo_and_config_writes_are_atomic_and_keep_every_update(tmp_path):
    """Memos and TOML files are written atomically (a reader never sees half a file), and two writers keep each
    other's entries."""
    code = textwrap.dedent("""
        import sys
        from localspec.store import cachefile
        from localspec import settings as config
        tag = sys.argv[1]
        for i in range(25):
            cachefile.update_json("memo.json", lambda d: d.__setitem__(f"{tag}{i}", "x" * 20000))
            config.update_file(config.config_file(), lambda d: d.setdefault("tuned", {}).__setitem__(f"{tag}{i}", {"k": i}))
    """)
    memo = Path(os.environ["LOCALSPEC_CACHE_DIR"]) / "memo.json"
    bad = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            try:
                text = memo.read_text()
            except FileNotFoundError:
                continue
            try:
                json.loads(text)
            except ValueError:
                bad.append(len(text))

    t = threading.Thread(target=reader)
    t.start()
    procs = [subprocess.Popen([sys.executable, "-c", code, tag]) for tag in ("a", "b")]
    for p in procs:
        assert p.wait(timeout=120) == 0
    stop.set()
    t.join()
    assert not bad, f"a reader saw {len(bad)} half-written memo files"
    assert len(json.loads(memo.read_text())) == 50
    assert len(config.load_toml(config.config_file())["tuned"]) == 50


def test_four_concurrent_runs_with_a_cold_probe_cache(target_path, draft_path):
    procs = [subprocess.Popen([sys.executable, "-m", "localspec", "run", "-m", str(target_path), "-d", str(draft_path),
                               "--method", "draft", "-k", "3", "-n", "16", "--json", "--raw", f"the cat {i}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(4)]
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err.decode()
        assert json.loads(out)["completion_tokens"] == 16


def test_generation_slot_makes_a_second_run_wait(target_path):
    """Two runs at once do not fight over the cores: the second waits for a generation slot and says so."""
    hold = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from localspec.session import generation_slot
        with generation_slot():
            print("held", flush=True)
            time.sleep(3)
    """)], stdout=subprocess.PIPE)
    assert hold.stdout.readline().strip() == b"held"
    t = time.monotonic()
    r = cli(["run", "-m", str(target_path), "-n", "4", "--raw", "hi"])
    waited = time.monotonic() - t
    hold.wait()
    assert r.returncode == 0, r.stderr
    assert b"waiting for another localspec generation to finish" in r.stderr
    assert waited > 1.0
    r = cli(["run", "-m", str(target_path), "-n", "4", "--raw", "hi"], env={"LOCALSPEC_PARALLEL": "x"})
    assert r.returncode == 2 and b"LOCALSPEC_PARALLEL" in r.stderr


def test_parallel_slots_allow_more(monkeypatch):
    monkeypatch.setenv("LOCALSPEC_PARALLEL", "2")
    with generation_slot() as a:
        with generation_slot() as b:
            assert {a, b} == {0, 1}


# ------------------------------------------------------------------ output and layering
def test_tables_into_a_pipe_are_not_cut():
    """`models list` into a pipe shows whole names, never cut ("qwen2.5-coder-1…")."""
    r = cli(["models", "list"])
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    assert "…" not in out and "qwen2.5-coder-1.5b (default)" in out
    assert "\x1b[" not in out and "[dim]" not in out
    r = cli(["config"])
    assert "…" not in r.stdout.decode() and "draft_gpu_layers" in r.stdout.decode()


def test_no_module_below_the_cli_imports_it():
    for path in PKG.rglob("*.py"):
        if path.name == "__main__.py" or path.parent.name == "cli":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                assert not node.module.endswith("cli") and node.module != "localspec.cli.main", f"{path} imports the CLI"


def test_header_reading_does_not_load_llama_cpp(target_path):
    code = (f"import sys; from localspec.models import pair as compat, gguf_header as gguf_meta, registry;"
            f"from localspec import session;"
            f"m = gguf_meta.read_file_metadata({str(target_path)!r}); v = gguf_meta.vocab_info(m);"
            f"assert compat.first_difference(v, v) is None; assert 'llama_cpp' not in sys.modules, 'loaded'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert r.returncode == 0, r.stderr.decode()


def test_a_broken_tuned_entry_is_ignored(tmp_path, monkeypatch):
    """`tuned = "string"` in config.toml is ignored (a broken tune entry never stops a command)."""
    cfg = tmp_path / "config.toml"
    cfg.write_text('tuned = "string"\nmethod = "lookup"\n')
    monkeypatch.setenv("LOCALSPEC_CONFIG", str(cfg))
    s = resolve_settings({})
    assert s["method"].value == "lookup" and s["draft_tokens"].source == "pair qwen2.5-coder-1.5b"
