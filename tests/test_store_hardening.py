"""Hardening of the models/store/settings layer (issue 19): hub names cannot reach outside localspec's caches,
every value localspec accepts round-trips through its TOML files, a broken config file can be repaired, export
never replaces a device node, rpc/tensor_split are checked when set, malformed pair and tune entries, history on
odd databases, GGUF magic for local targets."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from localspec.errors import UsageError
from localspec.models import download
from localspec.models import hubname
from localspec.models.spec import FileSpec

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"


def cli(args, env_extra=None, stdin=b""):
    return subprocess.run([sys.executable, "-m", "localspec", *args], capture_output=True, input=stdin,
                          env={**os.environ, **(env_extra or {})}, timeout=120)


def one_error_line(r, code=2):
    err = r.stderr.decode()
    assert r.returncode == code, (r.returncode, err)
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture
def home(env, monkeypatch):
    """env (fresh caches/config) with hub access off, and the mirror folder of REPO present (any mirror download
    creates it): the state in which `..` in a file name reached outside the cache."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LOCALSPEC_DATA_DIR", str(env / "data"))
    (env / "cache" / "mirrors" / REPO).mkdir(parents=True)
    return env


def escape_to(path: Path) -> str:
    """A file part that climbs out of any cache folder to `path`."""
    return "../" * 30 + str(path).lstrip("/")


# ---------------------------------------------------------------- 1. path traversal
def test_models_rm_cannot_delete_outside_the_cache(home):
    victim = home / "victim.gguf"
    victim.write_bytes(b"GGUF precious")
    part = home / "victim.gguf.part"
    part.write_bytes(b"partial")
    r = cli(["models", "rm", f"hf://{REPO}/{escape_to(victim)}", "--yes"])
    line = one_error_line(r)
    assert ".." in line
    assert victim.read_bytes() == b"GGUF precious" and part.exists()


def test_models_add_with_traversal_refused_and_a_hand_written_one_cannot_delete(home):
    victim = home / "victim2.gguf"
    victim.write_bytes(b"GGUF precious")
    r = cli(["models", "add", "evil", "--target", f"hf://{REPO}/{escape_to(victim)}"])
    one_error_line(r)
    assert not (home / "cfg" / "pairs.toml").exists()
    # the same pair written by hand (or by an older localspec): refused when read, naming the file
    (home / "cfg").mkdir(exist_ok=True)
    (home / "cfg" / "pairs.toml").write_text(
        f'[pairs.evil]\ndescription = "x"\n[pairs.evil.target]\nrepo = "{REPO}"\nfile = "{escape_to(victim)}"\n')
    r = cli(["models", "rm", "evil", "--yes"])
    line = one_error_line(r)
    assert "pairs.toml" in line and "evil" in line
    assert victim.exists()


def test_run_cannot_load_a_file_outside_the_cache(home, target_path):
    victim = home / "elsewhere.gguf"
    shutil.copy(target_path, victim)
    r = cli(["run", "-m", f"hf://{REPO}/{escape_to(victim)}", "-n", "2", "hi"])
    one_error_line(r)


@pytest.mark.parametrize("bad", ["../x.gguf", "a/../x.gguf", "./x.gguf", "a//x.gguf", "/etc/x.gguf", "a\\x.gguf",
                                 "x\x1b.gguf", "x\x00.gguf", "a/./x.gguf", "x.gguf/.."])
def test_hub_file_names_checked_where_they_enter(bad):
    with pytest.raises(UsageError):
        hubname.parse(f"hf://{REPO}/{bad}")
    with pytest.raises(UsageError):
        FileSpec.from_dict({"repo": REPO, "file": bad})
    with pytest.raises(UsageError):
        FileSpec(repo=REPO, file=bad)


@pytest.mark.parametrize("bad", ["a/..", "../b", "a/b/c", "a--b/c", "a/b..c", "/a", "a\\b/c", "a/b\x01"])
def test_hub_repo_names_checked(bad):
    with pytest.raises(UsageError):
        FileSpec(repo=bad, file="x.gguf")


@pytest.mark.parametrize("bad", ["../../x", "/abs", "a\\b", "a\nb", "a//b"])
def test_revisions_checked(bad):
    with pytest.raises(UsageError):
        FileSpec(repo=REPO, file="x.gguf", revision=bad)


def test_good_names_still_parse():
    h = hubname.parse(f"hf://{REPO}/sub/dir/model.Q4_K_M.gguf@refs/pr/1")
    assert h.file == "sub/dir/model.Q4_K_M.gguf" and h.revision == "refs/pr/1"
    assert FileSpec(repo="a_b/c.d-e", file="x..y.gguf").file == "x..y.gguf"  # '..' inside a name is no segment


def test_every_derived_path_and_delete_stays_inside_the_caches(home, monkeypatch):
    victim = home / "victim3.gguf"
    victim.write_bytes(b"GGUF precious")
    spec = FileSpec(repo=REPO, file="ok.gguf")
    object.__setattr__(spec, "file", escape_to(victim))  # past every check at the door
    with pytest.raises(UsageError):
        download.mirror_path(spec)
    with pytest.raises(UsageError):
        download.local_path(spec)
    with pytest.raises(UsageError):
        download.remove(spec)
    assert victim.exists()


def test_remove_does_not_follow_a_snapshot_link_out_of_the_cache(home, monkeypatch):
    victim = home / "victim4.gguf"
    victim.write_bytes(b"GGUF precious")
    snap = Path(download.hf_cache()) / f"models--{REPO.replace('/', '--')}" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "m.gguf").symlink_to(victim)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("0" * 40)
    assert download.local_path(FileSpec(repo=REPO, file="m.gguf")) is None  # a link out of the cache is no copy
    removed = download.remove(FileSpec(repo=REPO, file="m.gguf"))
    assert victim.exists()
    assert not (snap / "m.gguf").is_symlink() or removed == []


# ---------------------------------------------------------------- 2. TOML round trips, broken config files
NASTY = ["line1\r\nline2", "esc \x1b[31m red", "del \x7f", "nul-free \x01\x02\x1f", "tab\tand \"quotes\" \\ back",
         "modèle ünïcødé ✓ 日本", "cr\r", "\u2028 line sep \u0085 nel"]


@pytest.mark.parametrize("value", NASTY)
def test_config_values_round_trip(home, value):
    r = cli(["config", "set", "system", value])
    assert r.returncode == 0, r.stderr
    r = cli(["config", "--json"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["settings"]["system"]["value"] == value
    assert cli(["config", "unset", "system"]).returncode == 0


def test_pair_description_round_trips(home, target_path):
    r = cli(["models", "add", "x", "--target", str(target_path), "--description", "a\rb\x01\x7f\x1b"])
    assert r.returncode == 0, r.stderr
    r = cli(["models", "list", "--json"])
    assert r.returncode == 0, r.stderr
    assert next(p for p in json.loads(r.stdout) if p["name"] == "x")["description"] == "a\rb\x01\x7f\x1b"


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
def broken_config(home):
    cfg = home / "cfg" / "config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_bytes(b'model = "keep-me"\nsystem = "line1\r\\nline2"\nmax_tokens = 7\n')  # what the old writer wrote
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


# ---------------------------------------------------------------- 3. export over a non-regular file
def test_history_export_refuses_a_fifo(home):
    from localspec.store.history import History

    h = History()
    cid = h.new_chat("hello")
    h.add_message(cid, "user", "hello")
    h.close()
    fifo = home / "fifo"
    os.mkfifo(fifo)
    r = cli(["history", "export", str(cid), "-o", str(fifo), "--force"])
    one_error_line(r)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


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


# ---------------------------------------------------------------- 4. rpc / tensor_split checked when set
@pytest.mark.parametrize("key,value", [("rpc", "host:99999"), ("rpc", "nohost"), ("tensor_split", "abc"),
                                       ("tensor_split", "0,0")])
def test_config_set_checks_rpc_and_tensor_split(home, key, value):
    line = one_error_line(cli(["config", "set", key, value]))
    assert key in line
    assert not (home / "cfg" / "config.toml").exists()


def test_config_set_accepts_good_rpc(home):
    assert cli(["config", "set", "rpc", "127.0.0.1:50052"]).returncode == 0
    assert cli(["config", "set", "tensor_split", "3,1"]).returncode == 0


# ---------------------------------------------------------------- 5. malformed pair and tune entries
def test_pair_with_bad_k_names_file_and_key(home):
    (home / "cfg").mkdir(exist_ok=True)
    (home / "cfg" / "pairs.toml").write_text('[pairs.mine]\nk = "abc"\n[pairs.mine.target]\npath = "/x.gguf"\n')
    line = one_error_line(cli(["models", "list"]))
    assert "pairs.toml" in line and "mine" in line and "k" in line


def test_tuned_string_is_ignored(home, monkeypatch):
    from localspec import settings

    (home / "cfg").mkdir(exist_ok=True)
    (home / "cfg" / "config.toml").write_text('tuned = "string"\n')
    assert settings.tuned_results() == {}
    (home / "cfg" / "config.toml").write_text('[tuned]\ngood = { draft_tokens = 3 }\nbad = "x"\n')
    assert settings.tuned_results() == {"good": {"draft_tokens": 3}}


# ---------------------------------------------------------------- 6. history
def test_history_titles_lose_control_characters(home):
    from localspec.store.history import History

    h = History()
    cid = h.new_chat("\x1b]0;pwned\x07\x1b[2J hi \x9b31m there")
    c = h.chats()[0]
    assert c.id == cid and "\x1b" not in c.title and "\x07" not in c.title and "\x9b" not in c.title
    assert "hi" in c.title and "there" in c.title
    h.rename(cid, "new \x1b[31mname")
    assert "\x1b" not in h.get(cid).title
    # a title stored by an older localspec is cleaned when read
    h._db.execute("UPDATE chats SET title = ? WHERE id = ?", ("old \x1b[5m title", cid))
    assert "\x1b" not in h.chats()[0].title and "\x1b" not in h.get(cid).title
    h.close()
    r = cli(["history", "list"])
    assert r.returncode == 0 and b"\x1b[5m" not in r.stdout


def test_history_reads_a_read_only_data_dir(home):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere: the read-only case cannot be made here")
    from localspec.store.history import History, data_dir

    h = History()
    cid = h.new_chat("hello")
    h.add_message(cid, "user", "hello there")
    h.close()
    d = data_dir()
    modes = {p: p.stat().st_mode for p in [d, *d.iterdir()]}
    try:
        for p in modes:
            p.chmod(0o555 if p.is_dir() else 0o444)
        r = cli(["history", "list"])
        assert r.returncode == 0, r.stderr
        assert b"hello" in r.stdout
        r = cli(["history", "show", str(cid)])
        assert r.returncode == 0 and b"hello there" in r.stdout, r.stderr
    finally:
        for p, m in modes.items():
            p.chmod(m)


def test_history_read_only_database_file(home):
    """As root the folder test cannot run: a read-only connection is used when the file cannot be written."""
    from localspec.store.history import History

    p = home / "data" / "h.sqlite3"
    h = History(p)
    cid = h.new_chat("hello")
    h.add_message(cid, "user", "hello there")
    h.close()
    ro = History(p, readonly=True)
    assert ro.get(cid).messages[0]["content"] == "hello there" and ro.chats()[0].id == cid
    ro.close()


def test_damaged_stats_keeps_the_messages(home):
    from localspec.store.history import History

    h = History()
    cid = h.new_chat("hello")
    h.add_message(cid, "user", "hello")
    mid = h.add_message(cid, "assistant", "answer")
    h._db.execute("UPDATE messages SET stats = ? WHERE id = ?", ("{not json", mid))
    c = h.get(cid)
    assert [m["content"] for m in c.messages] == ["hello", "answer"] and c.messages[1]["stats"] is None
    h._db.execute("UPDATE messages SET stats = ? WHERE id = ?", ("[1, 2]", mid))  # JSON, but not an object
    assert h.get(cid).messages[1]["stats"] is None
    h.close()
    r = cli(["history", "export", str(cid), "-f", "json"])
    assert r.returncode == 0 and json.loads(r.stdout)["messages"][1]["content"] == "answer"


@pytest.mark.parametrize("cmd", [["show"], ["rm", "--yes"], ["export"]])
def test_history_huge_id_is_no_chat(home, cmd):
    from localspec.store.history import History

    History().close()
    line = one_error_line(cli(["history", cmd[0], "99999999999999999999999", *cmd[1:]]))
    assert "no chat" in line


def test_history_store_huge_and_negative_ids(home):
    from localspec.store.history import History

    h = History()
    for bad in (10 ** 30, -(10 ** 30)):
        for call in (h.get, h.delete, lambda i: h.rename(i, "t")):
            with pytest.raises(UsageError, match="no chat"):
                call(bad)
    h.close()


# ---------------------------------------------------------------- 7. GGUF magic for local targets
def test_models_add_refuses_a_non_gguf_file(home, target_path):
    notgguf = home / "passwd"
    notgguf.write_text("root:x:0:0:root:/root:/bin/bash\n")
    line = one_error_line(cli(["models", "add", "x", "--target", str(notgguf)]))
    assert "GGUF" in line
    line = one_error_line(cli(["models", "add", "x", "--target", str(target_path), "--draft", str(notgguf)]))
    assert "GGUF" in line
    assert not (home / "cfg" / "pairs.toml").exists()


@pytest.mark.parametrize("key,value,words", [("LOCALSPEC_MAX_TOKENS", "abc", "must be a whole number"),
                                             ("LOCALSPEC_TEMPERATURE", "hot", "must be a number")])
def test_a_setting_of_the_wrong_kind_is_worded_for_people(home, key, value, words):
    """The message read "max_tokens must be a int"."""
    line = one_error_line(cli(["config"], {key: value}))
    assert words in line and f"{value!r}" in line
