"""`localspec run` and the other commands through the entry point (in-process) and as real subprocesses: the
answer and its JSON, settings and their sources, help texts and summaries, and bad input as one `error:` line with
exit 2 (run, chat, config, bench, tune), pipes closed early, terminal escapes from model files kept off the
terminal."""

import json
import os
import subprocess
import sys

import pytest

from helpers import EVIL, cli, evil_model, no_controls, one_error_line, run_main

pytestmark = pytest.mark.usefixtures("isolated_config")

JSON_KEYS = {
    "text": str, "finish_reason": str, "method": str, "draft_tokens": int, "target": str, "prompt_tokens": int,
    "completion_tokens": int, "drafted": int, "accepted": int, "acceptance_rate": float, "mean_accepted_length": float,
    "ttft_s": float, "tokens_per_second": float, "elapsed_s": float,
}


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


def test_a_command_group_without_its_subcommand_shows_its_help_without_a_traceback():
    for group, sub in (("models", b"pull"), ("cache", b"clear"), ("history", b"export")):
        r = cli([group])
        assert r.returncode == 2, (group, r.returncode, r.stderr)  # what click's standalone mode exits with
        assert sub in r.stdout, (group, r.stdout)  # the group's help, which lists its subcommands
        assert b"Traceback" not in r.stderr and b"Error" not in r.stderr, (group, r.stderr)


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
    """12 tokens in under 50 ms still have a rate in --json and the server's stats: the live display's noise floor
    (no rate under 50 ms) is for the display only."""
    from types import SimpleNamespace

    from localspec.cli.render import result_json
    from localspec.server.openai import localspec_stats
    from localspec.core.stats import Stats
    from localspec.core.engine import GenConfig

    st = Stats(completion_tokens=12, elapsed_s=0.02)
    eng = SimpleNamespace(target=SimpleNamespace(name="t.gguf"), draft=None, dropped_draft=None)
    fin = SimpleNamespace(text="x", finish_reason="length")
    d = result_json(fin, st, eng, GenConfig())
    assert d["tokens_per_second"] == pytest.approx(600.0)
    assert localspec_stats(st, GenConfig())["tokens_per_second"] == pytest.approx(600.0)
    one = Stats(completion_tokens=1, elapsed_s=0.02)  # one token has no rate
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


# ------------------------------------------------------------------ flags, settings, summaries
@pytest.mark.parametrize("args,needle", [
    (["--threads", "100000"], "threads"),
    (["--threads", "0"], "threads"),
    (["--seed", "-5"], "seed"),
    (["-t", "nan"], "temperature"),
    (["-t", "inf"], "temperature"),
    (["-k", "999"], "draft tokens"),
    (["--top-p", "nan"], "top"),
])
def test_bad_values_are_one_error_line_exit_2(target_path, args, needle):
    r = cli(["run", "-m", str(target_path), "-n", "4", "--raw", *args, "hi"])
    assert needle in one_error_line(r, 2)


@pytest.mark.parametrize("args", [["-t", "nan"], ["-k", "999"], ["--threads", "100000"]])
def test_chat_validates_like_run(target_path, args):
    """`chat` refuses the values `run` refuses, before it needs a terminal."""
    r = cli(["chat", "-m", str(target_path), *args], timeout=30)
    one_error_line(r, 2)


def test_closed_stdout_and_help_into_head(target_path):
    """A closed stdout, or a reader that goes away (`--help | head -1`), ends the command quietly with exit 0."""
    r = subprocess.run(f"{sys.executable} -m localspec run -m {target_path} -n 4 --raw hi >&-", shell=True,
                       capture_output=True, timeout=60)
    assert r.returncode == 0 and b"Traceback" not in r.stderr and b"Error" not in r.stderr, r.stderr
    r = subprocess.run(f"{sys.executable} -m localspec --help | head -1; exit ${{PIPESTATUS[0]}}", shell=True,
                       executable="/bin/bash", capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert b"Traceback" not in r.stderr and b"Exception" not in r.stderr
    for cmd in ("--help", "models list", "config"):  # the reader gone before anything is written
        r = subprocess.run(f"{sys.executable} -m localspec {cmd} | true; exit ${{PIPESTATUS[0]}}", shell=True,
                           executable="/bin/bash", capture_output=True, timeout=60)
        assert r.returncode == 0 and r.stderr == b"", (cmd, r.stderr)


def test_config_file_errors_are_clear(tmp_path, target_path):
    """A config file that is not UTF-8, LOCALSPEC_CONFIG naming a folder, or TOML that does not parse: one `error:`
    line, exit 2."""
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"max_tokens = 3\n\xff\xfe\n")
    r = cli(["run", "-m", str(target_path), "--raw", "hi"], env={"LOCALSPEC_CONFIG": str(bad)})
    assert "UTF-8" in one_error_line(r, 2)
    r = cli(["run", "-m", str(target_path), "--raw", "hi"], env={"LOCALSPEC_CONFIG": str(tmp_path)})
    assert "directory" in one_error_line(r, 2)
    bad.write_text("max_tokens = = 3\n")
    r = cli(["config"], env={"LOCALSPEC_CONFIG": str(bad)})
    one_error_line(r, 2)


def test_rates_from_tiny_samples_are_not_shown(target_path):
    """One token is no sample for a rate: `-n 1` shows no tok/s (null in --json, a dash in the summary)."""
    r = cli(["run", "-m", str(target_path), "-n", "1", "--json", "--raw", "hi"])
    d = json.loads(r.stdout)
    assert d["completion_tokens"] == 1 and d["tokens_per_second"] is None
    r = cli(["run", "-m", str(target_path), "-n", "1", "--raw", "hi"])
    assert "— tok/s" in r.stderr.decode()


def test_llama_cpp_aliases_and_runtime_flags(target_path):
    r = cli(["run", "-m", str(target_path), "-n", "3", "--temp", "0", "-ngl", "0", "--n-gpu-layers", "0", "--json",
             "--raw", "hi"])
    assert r.returncode == 0, r.stderr
    for cmd in ("bench", "tune"):
        h = cli([cmd, "--help"]).stdout.decode()
        assert "--gpu-layers" in h and "--draft-gpu-layers" in h and "--threads" in h


def test_help_has_descriptions_defaults_and_no_type_names():
    h = cli(["run", "--help"], env={"COLUMNS": "200"}).stdout.decode()
    assert "<bool>" not in h and "<str>" not in h and "<int>" not in h and "<float>" not in h
    assert "(default: 512)" in h and "(default: auto)" in h
    for opt in ("--top-k", "--top-p", "--min-p", "--seed", "--ctx-size", "--threads"):
        line = next(l for l in h.splitlines() if opt in l)
        assert len(line.split("│")[1].split(opt)[1].strip()) > 5, line  # a description follows the option


def test_short_summary_by_default_full_with_verbose(target_path, draft_path):
    base = ["run", "-m", str(target_path), "-d", str(target_path), "--method", "draft", "-k", "2", "-n", "40", "--raw", "the cat"]
    short = cli(base).stderr.decode().strip().splitlines()[-1]
    assert short.startswith("40 tokens · ") and "tok/s" in short and "accepted" in short and "|" not in short
    full = cli(base + ["-v"]).stderr.decode().strip().splitlines()[-1]
    assert "tokens per target pass" in full and "mean accepted length" in full and "ttft" in full


def test_json_reports_requested_k_and_k_in_use(target_path):
    d = json.loads(cli(["run", "-m", str(target_path), "-d", str(target_path), "--method", "draft", "-k", "3", "-n", "8",
                        "--json", "--raw", "hi"]).stdout)
    assert d["draft_tokens"] == 3 and d["k_requested"] == 3 and isinstance(d["k_in_use"], int) and d["k_in_use"] <= 3
    assert "tokens_per_pass" in d and "drafting_steps" in d


def test_config_set_and_unset(target_path):
    r = cli(["config", "set", "max-tokens", "3"])
    assert r.returncode == 0, r.stderr
    assert json.loads(cli(["run", "-m", str(target_path), "--json", "--raw", "hi"]).stdout)["completion_tokens"] == 3
    shown = json.loads(cli(["config", "--json"]).stdout)["settings"]["max_tokens"]
    assert shown["value"] == 3 and shown["source"].startswith("file ")
    assert "temperature" in one_error_line(cli(["config", "set", "temperature", "nan"]), 2)
    assert "did you mean method" in one_error_line(cli(["config", "set", "methd", "auto"]), 2)
    assert cli(["config", "unset", "max_tokens"]).returncode == 0
    assert json.loads(cli(["config", "--json"]).stdout)["settings"]["max_tokens"]["source"] == "default"


def test_config_set_takes_a_negative_number_as_the_value():
    assert cli(["config", "set", "gpu_layers", "-1"]).returncode == 0
    shown = json.loads(cli(["config", "--json"]).stdout)["settings"]["gpu_layers"]
    assert shown["value"] == -1 and shown["source"].startswith("file ")
    line = one_error_line(cli(["config", "set", "suffix_cache_tokens", "-1"]))
    assert "suffix_cache_tokens" in line and ">= 0" in line
    assert json.loads(cli(["config", "--json"]).stdout)["settings"]["gpu_layers"]["value"] == -1  # the file kept
    one_error_line(cli(["config", "set", "--bogus", "gpu_layers", "1"]))  # an unknown option stays an error



# ------------------------------------------------------------------ bench and tune check their input first
BENCH = ["bench", "--methods", "lookup", "--k", "2", "-n", "4", "--limit", "1", "--categories", "code"]


def test_bench_output_paths_checked_before_the_run(target_path):
    r = cli(["bench", "-m", str(target_path), "--methods", "lookup", "--k", "2", "-n", "4", "--limit", "1",
             "--json", "/no/such/dir/x.json"], timeout=30)
    assert "/no/such/dir" in one_error_line(r, 2)


def test_bench_refuses_one_path_for_two_reports(target_path, tmp_path):
    """`--json F --csv F` is a usage error: one file cannot hold both reports."""
    f = tmp_path / "report"
    r = cli([*BENCH, "-m", str(target_path), "--json", str(f), "--csv", str(f)], timeout=120)
    assert "--json and --csv" in one_error_line(r, 2) and not f.exists() and r.stdout == b""


def test_bench_plot_without_matplotlib_fails_before_the_run(target_path, tmp_path):
    """`--plot` without matplotlib is refused before the benchmark runs."""
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    env = {"PYTHONPATH": str(tmp_path / "shadow") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = cli([*BENCH, "-m", str(target_path), "--plot", str(tmp_path / "x.png")], env=env, timeout=120)
    assert "matplotlib" in one_error_line(r, 2) and r.stdout == b""  # no report: nothing ran


@pytest.mark.parametrize("content,needle", [
    (b'{"prompt": "hi"}\n[1, 2]\n', "line 2"),
    (b'"just a string"\n', "line 1"),
    (b'\xff\xfe\x00\x01binary', "UTF-8"),
    (b'{"prompt": "hi", "category": 5}\n', "line 1"),
    (b'{"prompt": "hi", "id": [1]}\n', "line 1"),
])
def test_bad_prompts_file_is_a_usage_error_before_any_model_loads(tmp_path, content, needle):
    """A prompts file line that is no object, a field of the wrong type or a binary file: one usage line naming the
    file and line, before any model loads (the model does not even exist here)."""
    f = tmp_path / "prompts.jsonl"
    f.write_bytes(content)
    r = cli([*BENCH[:-2], "-m", str(tmp_path / "absent.gguf"), "--prompts", str(f)], timeout=60)
    line = one_error_line(r, 2)
    assert str(f) in line and needle in line


@pytest.mark.parametrize("cmd", ["bench", "tune"])
@pytest.mark.parametrize("limit", ["0", "-1"])
def test_a_limit_under_one_is_a_usage_error_not_the_whole_set(tmp_path, cmd, limit):
    """`--limit 0` read as no limit would run every built-in prompt, and `--limit -1` none: both are one usage line
    naming --limit, before any model loads (the model does not even exist here)."""
    r = cli([cmd, "-m", str(tmp_path / "absent.gguf"), "--limit", limit], timeout=60)
    assert "--limit" in one_error_line(r, 2)


def test_bench_k_list_must_not_be_empty(tmp_path):
    """`--methods auto --k ,` (no k at all) is a usage error naming --k, not a ValueError."""
    r = cli(["bench", "-m", str(tmp_path / "absent.gguf"), "--methods", "auto", "--k", ","], timeout=60)
    assert "--k" in one_error_line(r, 2)


def test_tune_blames_the_flag_that_is_wrong(tmp_path):
    """`tune --p-min abc` names --p-min, not another flag."""
    r = cli(["tune", "-m", str(tmp_path / "absent.gguf"), "--p-min", "abc"], timeout=60)
    line = one_error_line(r, 2)
    assert "--p-min" in line and "--k" not in line


def test_invalid_utf8_argument_is_one_usage_line():
    """Invalid UTF-8 in argv is one usage line (exit 2), not a UnicodeEncodeError."""
    for args in ([b"run", b"-n", b"4", b"caf\xe9"], [b"\xff"]):
        r = subprocess.run([sys.executable.encode(), b"-m", b"localspec", *args], capture_output=True, timeout=60)
        assert "UTF-8" in one_error_line(r, 2)


@pytest.mark.parametrize("value,debug", [("1", True), ("0", False), ("", False)])
def test_localspec_debug_restores_llama_cpp_backtraces(value, debug):
    """LOCALSPEC_DEBUG=1 (the name the README and --help give) lets ggml print its backtrace; otherwise it is off."""
    code = ("import os; from localspec.llama import lib; "
            "print(lib.DEBUG, os.environ.get('GGML_NO_BACKTRACE'))")
    env = {k: v for k, v in os.environ.items() if k != "GGML_NO_BACKTRACE"} | {"LOCALSPEC_DEBUG": value}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ([str(debug), "None"] if debug else [str(debug), "1"])


@pytest.mark.parametrize("name", ["x.txt", "chart.json", "x.PNG.bak"])
def test_bench_plot_with_an_unknown_extension_fails_before_the_run(target_path, tmp_path, name):
    """`bench --plot x.txt`: a format matplotlib cannot write is refused before the benchmark runs."""
    r = cli([*BENCH, "-m", str(target_path), "--plot", str(tmp_path / name)], timeout=120)
    line = one_error_line(r, 2)
    assert "--plot" in line and name.rsplit(".", 1)[1] in line and ".png" in line and r.stdout == b""
    assert not (tmp_path / name).exists()


def test_run_error_and_doctor_lines_hold_no_control_characters(tmp_path, monkeypatch):
    """A file name or general.name with terminal escapes reaches the terminal as spaces through run's warnings, the
    error line, doctor's probe list and the session's notices."""
    from localspec.session import Session

    f = evil_model(tmp_path / f"evil{EVIL}.gguf", chat_template=None)  # no template: run warns, naming the file
    r = cli(["run", "-m", str(f), "-n", "2", "hello"], timeout=120)
    assert r.returncode == 0 and "no chat template" in r.stderr.decode(), r.stderr
    no_controls(r.stderr.decode())
    r = cli(["run", "-m", str(tmp_path / "absent" / f.name), "hi"])
    assert "not found" in one_error_line(r, 2)
    no_controls(r.stderr.decode())
    r = cli(["doctor"], timeout=120)
    assert r.returncode == 0 and "pwned" in r.stdout.decode(), r.stderr  # the exactness probe of the run above
    no_controls(r.stdout.decode())
    seen: list[str] = []
    sess = Session({"model": str(f), "ctx_size": 256}, quiet=True, announce=seen.append)
    try:
        sess.load()
        notes = list(sess.notices())
    finally:
        sess.close()
    assert seen and notes
    for line in seen + notes:
        no_controls(line)
