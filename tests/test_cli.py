"""`localspec run` and friends, through the entry point (in-process) and as real subprocesses."""

import json
import os
import signal
import subprocess
import sys

import pytest

from tinymodels import write_model

JSON_KEYS = {
    "text": str, "finish_reason": str, "method": str, "draft_tokens": int, "target": str, "prompt_tokens": int,
    "completion_tokens": int, "drafted": int, "accepted": int, "acceptance_rate": float, "mean_accepted_length": float,
    "ttft_s": float, "tokens_per_second": float, "elapsed_s": float,
}


@pytest.fixture(autouse=True)
def isolated_config(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for k in list(os.environ):
        if k.startswith("LOCALSPEC_") and k not in ("LOCALSPEC_CONFIG_DIR", "LOCALSPEC_CACHE_DIR", "LOCALSPEC_TEST_MODELS"):
            monkeypatch.delenv(k)


def cli(args, stdin=None, env=None, timeout=60):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "localspec", *args], input=stdin, capture_output=True,
                          timeout=timeout, env=e)


def one_error_line(r, code):
    err = r.stderr.decode()
    assert r.returncode == code, (r.returncode, err)
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_json_keys_and_types(target_path, draft_path):
    r = cli(["run", "-m", str(target_path), "-d", str(draft_path), "--method", "draft", "-k", "3", "-n", "12", "--json", "--raw", "hello"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.decode().splitlines()
    assert len(lines) == 1  # exactly one JSON object
    d = json.loads(lines[0])
    for k, t in JSON_KEYS.items():
        assert isinstance(d[k], t), (k, d[k])
    assert d["draft"] == draft_path.name and d["target"] == target_path.name
    assert d["finish_reason"] == "length" and d["completion_tokens"] == 12
    assert d["method"] in ("draft", "none") and d["draft_tokens"] == 3


def test_stdout_is_only_the_answer(target_path):
    j = cli(["run", "-m", str(target_path), "-n", "20", "--json", "--raw", "the cat"])
    text = json.loads(j.stdout)["text"]
    r = cli(["run", "-m", str(target_path), "-n", "20", "--raw", "the cat"])
    assert r.returncode == 0
    assert r.stdout.decode() == text + ("" if text.endswith("\n") else "\n")
    assert "tok/s" in r.stderr.decode() and "tok/s" not in r.stdout.decode()
    q = cli(["run", "-q", "-m", str(target_path), "-n", "20", "--raw", "the cat"])
    assert q.stderr == b"" and q.stdout == r.stdout
    ns = cli(["run", "--no-stream", "-m", str(target_path), "-n", "20", "--raw", "the cat"])
    assert ns.stdout == r.stdout


def test_stdin_is_joined_before_prompt(target_path):
    from localspec.llama.model import Model
    with Model(target_path, n_ctx=256) as m:
        expected = len(m.tokenize("piped\n\nquestion", parse_special=False))
    r = cli(["run", "-m", str(target_path), "-n", "2", "--json", "--raw", "question"], stdin=b"piped")
    assert json.loads(r.stdout)["prompt_tokens"] == expected
    r = cli(["run", "-m", str(target_path), "-n", "2", "--json", "--raw"], stdin=b"only stdin")
    assert r.returncode == 0
    # no subcommand: `localspec "prompt"` is `localspec run "prompt"`
    r = subprocess.run([sys.executable, "-m", "localspec", "-m", str(target_path), "-n", "2", "--json", "--raw", "x"], capture_output=True)
    assert r.returncode == 0 and json.loads(r.stdout)["completion_tokens"] == 2


def test_bad_inputs(target_path, other_vocab_path, tmp_path):
    t = str(target_path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(os.urandom(4096))
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(target_path.read_bytes()[:3000])
    cases = [
        (["run", "-m", str(tmp_path / "missing.gguf"), "hi"], 2, "not found"),
        (["run", "-m", str(junk), "hi"], 1, "not a GGUF"),
        (["run", "-m", str(trunc), "hi"], 1, "could not load"),
        (["run", "-m", "no-such-pair", "hi"], 2, "unknown model pair"),
        (["run", "-m", "qwen2.5-coder-1.5", "hi"], 2, "did you mean qwen2.5-coder-1.5b"),
        (["run", "-m", t, "-k", "-2", "hi"], 2, "between 0 and"),
        (["run", "-m", t, "-k", "100000", "hi"], 2, "between 0 and"),
        (["run", "-m", t, "--method", "fast", "hi"], 2, "unknown method"),
        (["run", "-m", t, "-t", "nan", "hi"], 2, "temperature"),
        (["run", "-m", t, "-t", "-1", "hi"], 2, "temperature"),
        (["run", "-m", t, "   "], 2, "no prompt"),
        (["run", "-m", t, "-c", "64", "--raw", "word " * 300], 1, "-c "),
        (["run", "-m", t, "--bogus", "hi"], 2, "No such option"),
    ]
    for args, code, needle in cases:
        line = one_error_line(cli(args, stdin=b""), code)
        assert needle in line, (args, line)
    line = one_error_line(cli(["run", "-m", t, "hi"], stdin=b"\xff\xfe bad"), 2)
    assert "UTF-8" in line


def test_draft_with_another_vocabulary_drafts_through_text(target_path, other_vocab_path):
    for method in ("draft", "auto"):
        r = cli(["run", "-m", str(target_path), "-d", str(other_vocab_path), "--method", method, "-n", "8", "--json",
                 "--raw", "hi"])
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout)
        assert d["draft"] == other_vocab_path.name and d["draft_kind"] == "cross-vocab" and d["draft_dropped"] is None
    r = cli(["run", "-m", str(target_path), "--method", "none", "-n", "2", "--json", "--raw", "hi"])
    assert json.loads(r.stdout)["draft_kind"] is None


def test_broken_pipe_is_quiet(target_path):
    p = subprocess.run(f"{sys.executable} -m localspec run -m {target_path} -n 1500 --raw hi | head -c 5",
                       shell=True, capture_output=True, timeout=60)
    assert len(p.stdout) == 5
    assert b"Traceback" not in p.stderr and b"Error" not in p.stderr


@pytest.fixture(scope="module")
def long_ctx_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("long") / "long.gguf", 3, n_ctx_train=65536)


def test_sigint_keeps_partial_output_and_exits_130(long_ctx_model):
    p = subprocess.Popen([sys.executable, "-m", "localspec", "run", "-m", str(long_ctx_model), "-c", "60000",
                          "-n", "59000", "--method", "lookup", "--raw", "the cat"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.read(20)  # generation has started
    assert first
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert b"Traceback" not in err and b"interrupted" in err
    assert len(first + rest) > 20


def test_config_precedence(target_path, tmp_path):
    cfg = tmp_path / "cfg"
    cfg.mkdir(exist_ok=True)
    (cfg / "config.toml").write_text("max_tokens = 3\ntemperature = 0.0\n")
    base = ["run", "-m", str(target_path), "--json", "--raw", "hi"]
    assert json.loads(cli(base).stdout)["completion_tokens"] == 3
    assert json.loads(cli(base, env={"LOCALSPEC_MAX_TOKENS": "4"}).stdout)["completion_tokens"] == 4
    assert json.loads(cli(base + ["-n", "5"], env={"LOCALSPEC_MAX_TOKENS": "4"}).stdout)["completion_tokens"] == 5
    shown = json.loads(cli(["config", "--json"], env={"LOCALSPEC_MAX_TOKENS": "4"}).stdout)
    assert shown["settings"]["max_tokens"] == {"value": 4, "source": "env LOCALSPEC_MAX_TOKENS"}
    assert shown["settings"]["temperature"]["source"].startswith("file ")
    assert shown["settings"]["method"]["source"] == "default"
    assert shown["settings"]["exactness"] == {"value": "auto", "source": "default"}
    assert shown["settings"]["gpu_layers"] == {"value": None, "source": "default"}  # resolved at load time
    bad = cli(base, env={"LOCALSPEC_MAX_TOKENS": "many"})
    assert "LOCALSPEC_MAX_TOKENS" in one_error_line(bad, 2)


def test_version_and_help():
    r = cli(["--version"])
    assert r.returncode == 0 and b"localspec" in r.stdout and b"llama-cpp-python" in r.stdout
    r = cli(["run", "--help"])
    assert r.returncode == 0 and b"--draft-tokens" in r.stdout and b"Examples" in r.stdout


def run_main(args, capsys, monkeypatch):
    """The entry point in-process (so a test can stub the exactness probe): (exit code, stdout, stderr)."""
    import io

    from localspec.cli.app import main

    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # nothing piped
    with pytest.raises(SystemExit) as exc:
        main(args)
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def test_auto_exactness_speculates_lossless_when_probe_answers_1(target_path, monkeypatch, capsys):
    import localspec.core.exactness as ex

    monkeypatch.setattr(ex, "max_exact_batch", lambda model, upto: 1)  # what a GPU build measures
    base = ["run", "-m", str(target_path), "-d", str(target_path), "--method", "draft", "-k", "4", "-n", "24", "--raw", "the cat"]
    code, out, err = run_main(base + ["--json"], capsys, monkeypatch)
    assert code == 0, err
    d = json.loads(out)
    assert d["exactness"] == "lossless" and d["exactness_reason"].startswith("lossless: bit-exact verify needs k <= 0")
    assert d["drafted"] > 0 and d["steps_by_k"].get("4", 0) > 0
    code, out, err = run_main(base + ["--exactness", "bit", "-v"], capsys, monkeypatch)
    assert code == 0 and "bit: verify batches of 2 or more rows are not bit-identical" in err  # the summary line
    code, out, err = run_main(base + ["--exactness", "close-enough"], capsys, monkeypatch)
    assert code == 2 and err.startswith("error: unknown exactness")
    monkeypatch.setenv("LOCALSPEC_EXACTNESS", "bit")  # the config key, from the environment
    code, out, err = run_main(base + ["--json"], capsys, monkeypatch)
    assert code == 0 and json.loads(out)["exactness"] == "bit" and json.loads(out)["drafted"] == 0


def test_json_rate_is_a_number_even_for_a_fast_answer():
    """CI regression: 12 tokens in under 50 ms gave "tokens_per_second": null (the live display's noise floor)."""
    from types import SimpleNamespace

    from localspec.cli.render import result_json
    from localspec.server.app import localspec_stats
    from localspec.core.stats import Stats
    from localspec.core.engine import GenConfig

    st = Stats(completion_tokens=12, elapsed_s=0.02)
    eng = SimpleNamespace(target=SimpleNamespace(name="t.gguf"), draft=None, dropped_draft=None)
    fin = SimpleNamespace(text="x", finish_reason="length")
    d = result_json(fin, st, eng, GenConfig())
    assert d["tokens_per_second"] == pytest.approx(600.0)
    assert localspec_stats(st, GenConfig())["tokens_per_second"] == pytest.approx(600.0)
    one = Stats(completion_tokens=1, elapsed_s=0.02)  # one token has no rate (#15.14)
    assert result_json(fin, one, eng, GenConfig())["tokens_per_second"] is None


def test_models_info_and_doctor_say_how_speculation_rolls_back_and_which_heads_exist(tmp_path, target_path):
    """`models info` names each model's rollback (kv, rs state planes, checkpoint + replay) from its header, and
    `doctor` lists the draft heads this llama.cpp build supports."""
    from tinymodels import write_lfm2, write_mamba

    lfm2, mamba = write_lfm2(tmp_path / "h.gguf", 3), write_mamba(tmp_path / "m.gguf", 3)
    kinds = {}
    for path in (target_path, lfm2, mamba):
        r = cli(["models", "info", str(path), "--json"])
        assert r.returncode == 0, r.stderr
        kinds[path.name] = json.loads(r.stdout)["model"]["rollback"]
    assert kinds == {target_path.name: "kv", "h.gguf": "rs", "m.gguf": "checkpoint"}
    r = cli(["doctor", "--json"])
    assert r.returncode == 0, r.stderr
    heads = json.loads(r.stdout)["draft_heads"]
    assert heads["eagle3"] == "supported" and heads["mtp"] == "supported" and heads["dflash"].startswith("supported")
