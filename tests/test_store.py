"""localspec's own files: every value it accepts round-trips through config.toml (store/tomlfile.py), a broken
config file is reported with its repair and can be repaired, writes are atomic and never replace a special file,
and settings are checked when set (rpc, tensor_split) and worded for people when read."""

from __future__ import annotations

import json
import os
import stat

import pytest

from helpers import cli, one_error_line
from localspec.errors import UsageError

pytestmark = pytest.mark.usefixtures("isolated_config")


NASTY = ["line1\r\nline2", "esc \x1b[31m red", "del \x7f", "nul-free \x01\x02\x1f", "tab\tand \"quotes\" \\ back",
         "modèle ünïcødé ✓ 日本", "cr\r", "\u2028 line sep \u0085 nel"]


@pytest.mark.parametrize("value", NASTY)
def test_config_values_round_trip(value):
    r = cli(["config", "set", "system", value])
    assert r.returncode == 0, r.stderr
    r = cli(["config", "--json"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["settings"]["system"]["value"] == value
    assert cli(["config", "unset", "system"]).returncode == 0


def test_library_round_trip_keys_and_nested(tmp_path):
    from localspec.store import tomlfile

    p = tmp_path / "c.toml"
    data = {"system": "\r\x1b\x7f", "n": 3, "f": 0.5, "b": True, "skip": None,
            "tuned": {"./modèle": {"draft_tokens": 5, "tuned_at": "2026-01-01 00:00"}, "a.b\"c": {"x": 1}},
            "pairs": {"p": {"target": {"repo": "a/b", "file": "f.gguf", "mirrors": [{"kind": "k", "first": 1}]}}}}
    tomlfile.update_file(p, lambda d: d.update(data))
    back = tomlfile.load_toml(p)
    data.pop("skip")
    assert back == data


@pytest.fixture
def broken_config(tmp_path):
    cfg = tmp_path / "cfg" / "config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    # a raw CR inside a TOML string: not TOML
    cfg.write_bytes(b'model = "keep-me"\nsystem = "line1\r\\nline2"\nmax_tokens = 7\n')
    return cfg


def test_broken_config_error_says_how_to_repair(broken_config):
    line = one_error_line(cli(["config"]))
    assert str(broken_config) in line and "localspec config unset system" in line


def test_broken_config_can_be_unset(broken_config):
    r = cli(["config", "unset", "system"])
    assert r.returncode == 0, r.stderr
    r = cli(["config", "--json"])
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["settings"]
    assert s["model"]["value"] == "keep-me" and s["max_tokens"]["value"] == 7 and s["system"]["value"] is None


def test_broken_config_other_key_not_silently_dropped(broken_config):
    from localspec.store import tomlfile

    before = broken_config.read_bytes()
    with pytest.raises(UsageError) as e:
        tomlfile.update_file(broken_config, lambda d: d.__setitem__("top_k", 3))
    assert "unset system" in str(e.value)
    assert broken_config.read_bytes() == before
    tomlfile.update_file(broken_config, lambda d: d.__setitem__("system", "fixed"))  # replacing it repairs it
    assert tomlfile.load_toml(broken_config) == {"model": "keep-me", "system": "fixed", "max_tokens": 7}


def test_atomic_write_refuses_non_regular_and_keeps_symlinks(tmp_path):
    from localspec.store.cachefile import atomic_write

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError):
        atomic_write(fifo, "x")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    real = tmp_path / "real.toml"
    real.write_text("old")
    link = tmp_path / "link.toml"
    link.symlink_to(real)
    atomic_write(link, "new")
    assert link.is_symlink() and real.read_text() == "new"
    atomic_write(tmp_path / "new.txt", "n")
    assert (tmp_path / "new.txt").read_text() == "n"


@pytest.mark.parametrize("key,value", [("rpc", "host:99999"), ("rpc", "nohost"), ("tensor_split", "abc"),
                                       ("tensor_split", "0,0")])
def test_config_set_checks_rpc_and_tensor_split(tmp_path, key, value):
    line = one_error_line(cli(["config", "set", key, value]))
    assert key in line
    assert not (tmp_path / "cfg" / "config.toml").exists()


def test_config_set_accepts_good_rpc():
    assert cli(["config", "set", "rpc", "127.0.0.1:50052"]).returncode == 0
    assert cli(["config", "set", "tensor_split", "3,1"]).returncode == 0


def test_tuned_string_is_ignored(tmp_path):
    from localspec import settings

    (tmp_path / "cfg").mkdir(exist_ok=True)
    (tmp_path / "cfg" / "config.toml").write_text('tuned = "string"\n')
    assert settings.tuned_results() == {}
    (tmp_path / "cfg" / "config.toml").write_text('[tuned]\ngood = { draft_tokens = 3 }\nbad = "x"\n')
    assert settings.tuned_results() == {"good": {"draft_tokens": 3}}


@pytest.mark.parametrize("key,value,words", [("LOCALSPEC_MAX_TOKENS", "abc", "must be a whole number"),
                                             ("LOCALSPEC_TEMPERATURE", "hot", "must be a number")])
def test_a_setting_of_the_wrong_kind_is_worded_for_people(key, value, words):
    """A setting of the wrong kind says what kind it needs in words ("must be a whole number"), not a type name."""
    line = one_error_line(cli(["config"], {key: value}))
    assert words in line and f"{value!r}" in line
