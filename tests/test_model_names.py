"""Model names and paths the file system cannot look up (too long, a `~user` that names no user) are usage errors
wherever a name is resolved: one `error:` line, exit 2, the name shortened; and `run --json` names the draft file
-d gave, a draft head's too."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import cli, one_error_line
from localspec.errors import UsageError
from localspec.models import registry
from localspec.models.spec import FileSpec

LONG = "a" * 5000


@pytest.fixture
def names_env(env, tmp_path):
    """Fresh config and caches, no hub access, an empty Ollama store."""
    (tmp_path / "ollama").mkdir()
    return {"HF_HUB_OFFLINE": "1", "OLLAMA_MODELS": str(tmp_path / "ollama"), "HOME": str(tmp_path / "home")}


def bad_names(target: str) -> list[list[str]]:
    return [
        ["run", "-m", LONG, "-n", "2", "hi"],
        ["run", "-m", f"./{LONG}.gguf", "-n", "2", "hi"],
        ["run", "-m", "a/" * 2500 + "x.gguf", "-n", "2", "hi"],  # every part short, the whole too long
        ["run", "-m", f"{LONG}/{LONG}", "-n", "2", "hi"],
        ["run", "-m", f"owner/repo:{LONG}", "-n", "2", "hi"],
        ["run", "-m", f"hf://owner/repo/{LONG}.gguf", "-n", "2", "hi"],
        ["run", "-m", f"ollama:{LONG}", "-n", "2", "hi"],
        ["run", "-m", f"ollama:tiny:{LONG}", "-n", "2", "hi"],
        ["run", "-m", f"ollama:{LONG}/{LONG}", "-n", "2", "hi"],
        ["run", "-m", target, "-d", LONG, "-n", "2", "hi"],
        ["run", "-m", target, "-d", f"ollama:{LONG}", "-n", "2", "hi"],
        ["run", "-m", "~no-such-user-here/x.gguf", "-n", "2", "hi"],
        ["models", "info", LONG],
        ["models", "info", f"ollama:{LONG}"],
        ["models", "info", f"./{LONG}.gguf"],
        ["models", "add", "p", "--target", LONG],
        ["models", "add", "p", "--target", target, "--draft", f"./{LONG}.gguf"],
        ["models", "add", "p", "--target", f"ollama:x:{LONG}"],
        ["models", "rm", LONG, "--yes"],
        ["models", "pull", LONG],
        ["models", "pull", f"./{LONG}.gguf"],
    ]


def test_names_too_long_for_the_file_system_are_usage_errors(names_env, target_path):
    for args in bad_names(str(target_path)):
        line = one_error_line(cli(args, names_env))
        assert len(line) < 500, (args[:3], line[:500])  # the name is shortened, not echoed whole
        assert "OSError" not in line and "RuntimeError" not in line, (args[:3], line)
    assert not registry.user_pairs_file().exists()  # nothing added


def test_the_common_checks(tmp_path):
    from localspec.models.spec import is_dir, is_file, user_path

    for check in (is_file, is_dir):
        with pytest.raises(UsageError, match="too long"):
            check(tmp_path / LONG)
        with pytest.raises(UsageError, match="too long"):
            check(tmp_path / ("a/" * 2500))
    assert is_dir(tmp_path) and not is_file(tmp_path) and not is_dir(tmp_path / "missing")
    with pytest.raises(UsageError, match="too long"):
        registry.resolve_name(LONG)
    with pytest.raises(UsageError, match="too long"):
        FileSpec.parse(f"{tmp_path}/{LONG}.gguf")
    with pytest.raises(UsageError, match="no-such-user-here"):
        user_path("~no-such-user-here/x.gguf")
    assert user_path("~/x.gguf") == Path(os.path.expanduser("~/x.gguf"))
    assert registry.resolve_name(str(tmp_path / "missing.gguf")) == ("path", tmp_path / "missing.gguf")


def test_a_pair_whose_path_is_too_long_is_one_error_line(names_env, env):
    """A pairs.toml entry written by hand with a path no file system takes: an error naming it, not a crash."""
    (env / "cfg").mkdir(exist_ok=True)
    (env / "cfg" / "pairs.toml").write_text(f'[pairs.long]\n[pairs.long.target]\npath = "/{LONG}.gguf"\n')
    for args in (["run", "-m", "long", "-n", "2", "hi"], ["models", "info", "long"], ["models", "list", "--json"]):
        line = one_error_line(cli(args, names_env))
        assert "too long" in line and len(line) < 500, line


# ----------------------------------------------------------------- a draft head given with -d is the run's draft
@pytest.fixture(scope="module")
def head_files(tmp_path_factory):
    from tinyheads import write_bigram_target, write_dspark, write_eagle3

    d = tmp_path_factory.mktemp("heads")
    return {"target": write_bigram_target(d / "bigram.gguf", 7),
            "eagle3": write_eagle3(d / "eagle3-agree.gguf", 3, agree_with=7),
            "dflash": write_dspark(d / "dspark-agree.gguf", 3, agree_with=7, wrong=0.2)}


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_run_json_names_a_draft_head_file(head_files, env, method):
    r = cli(["run", "-m", str(head_files["target"]), "-d", str(head_files[method]), "--method", method, "-n", "6",
             "--json", "--raw", "the cat"], {"LOCALSPEC_NO_COST_CALIBRATION": "1", "HF_HUB_OFFLINE": "1"},
            timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["draft_kind"] == "head" and d["draft"] == head_files[method].name, d


def test_tune_results_are_not_looked_up_for_a_name_the_file_system_refuses(names_env):
    from localspec.session import tuned_key

    for name in (f"hf://owner/repo/{LONG}.gguf", "~no-such-user-here/x.gguf", LONG):
        assert tuned_key(name, None) is None
        r = cli(["config", "--json", "-m", name], names_env)
        assert r.returncode == 0 and not r.stderr.strip(), r.stderr.decode()[-500:]
        assert json.loads(r.stdout)["settings"]["model"]["value"] == name
