"""The suffix cache's files as found on disk: a damaged, hostile or foreign file is skipped (never an error, never a
hang), only localspec's own files in its own folder are read, written or deleted, never through a symbolic link,
`cache build` reads no link and no hidden file, and what `cache show` prints holds no terminal escapes."""

from __future__ import annotations

import json
import os
import resource
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from helpers import cli, environ, one_error_line
from localspec.drafters import suffix_corpus as CO
from localspec.store import suffixcache as SC

pytestmark = pytest.mark.usefixtures("fresh_suffix_cache")

FP = "0123456789abcdef0123456789abcdef"  # a fingerprint as fingerprint() makes them: 32 hex digits
ROOT = Path(__file__).resolve().parents[1]
NESTED = b"[" * 200_000 + b"]" * 200_000


def doc(i, tokens):
    return CO.Doc(f"d{i}", float(i), tokens)


def body(tokens, fp=FP, t=1.0):
    return json.dumps({"format": SC.FORMAT, "vocab": fp, "docs": [{"id": "a", "t": t, "tokens": tokens}]})


def _limits():
    # a bounded address space: a reader that does not stop at a size bound fails fast instead of filling memory
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))


def cache_cli(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "localspec", "cache", *args], capture_output=True, timeout=timeout,
                          env=environ({"PYTHONPATH": str(ROOT), **(env or {})}), preexec_fn=_limits)


def within(seconds, fn):
    """fn()'s result, or a failure where it has not returned within `seconds` (a read blocked on a pipe)."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert "r" in out, f"still running after {seconds} s"
    return out["r"]


def no_escapes(r):
    text = r.stdout + r.stderr
    assert b"\x1b" not in text and b"\x07" not in text and b"\x9b" not in text, text


# ------------------------------------------------------------------ a hostile file is skipped, once noticed
@pytest.mark.parametrize("content,why", [
    (NESTED, "damaged"),
    (body([1, 2, 2**31]).encode(), "damaged"),
    (body([1, 2, -1]).encode(), "damaged"),
    (body([1, 2, True]).encode(), "damaged"),
    (body([1, 2, 3.0]).encode(), "damaged"),
    (body([1, 2, 3], t=10**400).encode(), "damaged"),
    (body([1, 2, 3]).replace("1.0", "NaN").encode(), "damaged"),
], ids=["nested", "id 2^31", "id -1", "id true", "id 3.0", "time 10^400", "time NaN"])
def test_a_hostile_file_reads_as_empty_with_one_notice(capsys, content, why):
    f = SC.SuffixFile(FP)
    f.path.parent.mkdir(parents=True)
    f.path.write_bytes(content)
    assert f.load() == [] and f.load() == []
    err = capsys.readouterr().err
    assert err.count("note: the suffix cache") == 1 and why in err, err
    assert f.save([doc(0, [1, 2, 3])])  # replaced by the next save
    assert f.load() == [("d0", 0.0, [1, 2, 3])]


def test_token_ids_beyond_the_vocabulary_are_refused(capsys, monkeypatch):
    monkeypatch.setitem(SC._VOCAB_SIZES, FP, 100)  # model_fingerprint() notes a loaded model's vocabulary size
    f = SC.SuffixFile(FP)
    f.path.parent.mkdir(parents=True)
    f.path.write_text(body([1, 2, 99]))
    assert f.load() == [("a", 1.0, [1, 2, 99])]
    f.path.write_text(body([1, 2, 100]))
    assert f.load() == []
    assert "damaged" in capsys.readouterr().err


def test_a_corpus_never_holds_an_id_past_its_models_vocabulary(target_path, capsys):
    """A file of this vocabulary's fingerprint whose ids reach past the vocabulary: an id the model has no token for
    would fail the target's decode as a draft."""
    from localspec.llama.model import Model

    with Model(target_path, n_ctx=256) as m:
        fp = SC.model_fingerprint(m)
        toks = m.tokenize("the cat and the dog", add_special=False)
        SC.folder().mkdir(parents=True)
        SC.path_for(fp).write_text(body(toks + [m.n_vocab + 7] * 4 + toks, fp=fp))
        corpus = CO.corpus_for(m)
        assert corpus.docs == [] and all(t < m.n_vocab for t in corpus.index.toks)
        assert "damaged" in capsys.readouterr().err
        CO._CORPORA.clear()
        SC.path_for(fp).write_text(body(toks + [m.n_vocab - 1] * 4 + toks, fp=fp))
        assert [d.id for d in CO.corpus_for(m).docs] == ["a"]


def test_a_file_over_the_size_bound_is_not_read(capsys, monkeypatch):
    monkeypatch.setattr(SC, "MIN_READ_BYTES", 1000)
    f = SC.SuffixFile(FP, max_tokens=10)
    f.path.parent.mkdir(parents=True)
    f.path.write_text(body(list(range(500))))
    assert f.load() == []
    assert "too large" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder", "dangling"])
def test_a_path_that_is_not_a_regular_file_is_skipped_and_left_alone(capsys, tmp_path, kind):
    f = SC.SuffixFile(FP)
    f.path.parent.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(f.path)
    elif kind == "dev-zero":
        f.path.symlink_to("/dev/zero")
    elif kind == "folder":
        f.path.mkdir()
    else:
        f.path.symlink_to(tmp_path / "absent")
    assert within(20, f.load) == []
    assert within(20, lambda: f.save([doc(0, [1, 2, 3])])) is False
    assert capsys.readouterr().err.count("note: the suffix cache") == 1
    assert not (tmp_path / "absent").exists()
    assert os.path.lexists(f.path) and not stat.S_ISREG(os.lstat(f.path).st_mode)


def test_the_memo_reader_skips_hostile_files(tmp_path):
    from localspec.store import cachefile

    folder = cachefile.cache_dir()
    folder.mkdir(parents=True)
    (folder / "nested.json").write_bytes(NESTED)
    os.mkfifo(folder / "fifo.json")
    (folder / "zero.json").symlink_to("/dev/zero")
    for name in ("nested.json", "fifo.json", "zero.json"):
        assert within(20, lambda: cachefile.read_json(name)) == {}


# ------------------------------------------------------------------ writes stay in localspec's own folder
def test_a_save_never_writes_through_a_symbolic_link(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    os.chmod(outside, 0o644)
    f = SC.SuffixFile(FP)
    f.path.parent.mkdir(parents=True)
    f.path.symlink_to(outside)
    assert f.save([doc(0, [1, 2, 3])]) is False
    assert outside.read_text() == "keep me" and stat.S_IMODE(outside.stat().st_mode) == 0o644


def test_a_symlinked_folder_is_never_followed(tmp_path, capsys):
    project = tmp_path / "project"
    project.mkdir()
    (project / "package.json").write_text("{}")
    (project / f"{FP}.json").write_text(body([1, 2, 3]))
    before = {p.name: p.read_bytes() for p in project.iterdir()}
    SC.folder().parent.mkdir(parents=True)
    SC.folder().symlink_to(project)
    f = SC.SuffixFile(FP)
    assert f.load() == []  # its file is not read ...
    assert f.save([doc(0, [1, 2, 3])]) is False  # ... nor written
    assert SC.files() == []
    assert SC.clear() == 0
    r = cache_cli("clear")
    assert r.returncode == 0, r.stderr
    assert {p.name: p.read_bytes() for p in project.iterdir()} == before
    assert SC.folder().is_symlink()


def test_a_symlinked_folder_costs_one_notice_per_process(tmp_path, capsys):
    (tmp_path / "elsewhere").mkdir()
    SC.folder().parent.mkdir(parents=True)
    SC.folder().symlink_to(tmp_path / "elsewhere")
    for f in (SC.SuffixFile(FP), SC.SuffixFile(FP, path=SC.static_path(FP)), SC.SuffixFile(FP, "0123456789abcdef")):
        assert f.load() == []
        assert f.save([doc(0, [1, 2, 3])]) is False
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and "folder" in err and "symbolic link" in err, err
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_a_notice_prints_no_escapes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "c\x1b]0;title\x07d"))
    f = SC.SuffixFile(FP)
    f.path.parent.mkdir(parents=True)
    f.path.write_bytes(b"{damaged")
    assert f.load() == []
    err = capsys.readouterr().err
    assert "damaged" in err and "\x1b" not in err and "\x07" not in err, err


def test_memos_never_write_through_a_symbolic_link(tmp_path):
    from localspec.store import cachefile

    outside = tmp_path / "outside.json"
    outside.write_text('{"mine": 1}')
    cachefile.cache_dir().mkdir(parents=True)
    (cachefile.cache_dir() / "memo.json").symlink_to(outside)
    cachefile.update_json("memo.json", lambda d: d.__setitem__("k", "v"))
    assert outside.read_text() == '{"mine": 1}'


def test_locks_are_never_taken_through_a_symbolic_link(tmp_path):
    from localspec.store import cachefile

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cachefile.cache_dir().mkdir(parents=True)
    (cachefile.cache_dir() / "locks").symlink_to(elsewhere)
    assert SC.SuffixFile(FP).save([doc(0, [1, 2, 3])]) is False
    assert list(elsewhere.iterdir()) == []
    (cachefile.cache_dir() / "locks").unlink()
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    lock = cachefile._lock_path(f"suffix-{FP}.json")
    lock.parent.mkdir(parents=True)
    lock.symlink_to(outside)
    assert SC.SuffixFile(FP).save([doc(0, [1, 2, 3])]) is False
    assert outside.read_text() == "keep me"


def test_a_save_is_atomic_and_private():
    f = SC.SuffixFile(FP)
    assert f.save([doc(0, [1, 2, 3])])
    assert stat.S_IMODE(os.lstat(f.path).st_mode) == 0o600
    assert sorted(p.name for p in SC.folder().iterdir()) == [f.path.name]  # no temporary file left


# ------------------------------------------------------------------ cache show and cache clear
def plant(folder: Path) -> dict:
    """Localspec's own files, others' files and things that are no files, in the suffix folder."""
    folder.mkdir(parents=True, exist_ok=True)
    own = {f"{FP}.json": body([1, 2, 3]), f"{FP}-0123456789abcdef.json": body([4, 5]),
           f"{FP}.static.json": body([6, 7, 8, 9])}
    for name, text in own.items():
        (folder / name).write_text(text)
    (folder / "package.json").write_text('{"name": "x"}')
    (folder / "tsconfig.json").write_text("{}")
    (folder / "x.json").mkdir()
    (folder / f"{'1' * 32}.json").mkdir()
    os.mkfifo(folder / f"{'2' * 32}.json")
    (folder / f"{'3' * 32}.json").write_bytes(NESTED)
    (folder / f"{'4' * 32}.json").write_text(body([1, 2**31]))
    (folder / f"{'5' * 32}.json").symlink_to("/dev/zero")
    (folder / "\x1b]0;title\x07\x1b[2J[bold]x.json").write_text(body([1, 2]))
    return own


def test_cache_show_skips_what_is_not_its_own_and_prints_no_escapes():
    plant(SC.folder())
    r = cache_cli("show")
    assert r.returncode == 0, r.stderr
    no_escapes(r)
    assert b"package.json" not in r.stdout and b"Traceback" not in r.stderr
    r = cache_cli("show", "--json")
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    by_name = {Path(f["file"]).name: f for f in shown["files"]}
    assert by_name[f"{FP}.json"]["tokens"] == 3 and by_name[f"{FP}.static.json"]["kind"] == "static"
    assert by_name[f"{'3' * 32}.json"]["tokens"] == 0 and by_name[f"{'4' * 32}.json"]["tokens"] == 0
    assert set(by_name) == {f"{FP}.json", f"{FP}-0123456789abcdef.json", f"{FP}.static.json", f"{'3' * 32}.json",
                            f"{'4' * 32}.json"}
    assert shown["total"]["tokens"] == 9


def test_cache_show_escapes_the_folder_name(tmp_path):
    odd = tmp_path / "c\x1b[2Jd\x07[red]x[/red]"
    r = cache_cli("show", env={"LOCALSPEC_CACHE_DIR": str(odd)})
    assert r.returncode == 0, r.stderr
    no_escapes(r)
    assert b"[red]x[/red]" in r.stderr


def test_cache_clear_deletes_only_its_own_files():
    folder = SC.folder()
    own = plant(folder)
    r = cache_cli("clear")
    assert r.returncode == 0, r.stderr
    no_escapes(r)
    left = sorted(os.listdir(folder))
    assert not set(own) & set(left)
    assert {"package.json", "tsconfig.json", "x.json", f"{'1' * 32}.json"} <= set(left)
    assert (folder / "package.json").read_text() == '{"name": "x"}'
    assert not os.path.lexists(folder / f"{'3' * 32}.json") and not os.path.lexists(folder / f"{'4' * 32}.json")
    assert os.path.exists("/dev/zero")


def test_a_hostile_cache_never_stops_show_clear_or_a_run(target_path):
    from localspec.llama.model import Model

    with Model(target_path, n_ctx=256) as m:
        fp = SC.model_fingerprint(m)
        past = m.n_vocab + 7
        toks = m.tokenize("the cat and the dog", add_special=False)
    run = ["run", "-m", str(target_path), "--method", "suffix", "-n", "8", "--raw", "the cat and the dog"]
    cases = {"nested": lambda p: p.write_bytes(NESTED), "fifo": os.mkfifo,
             "dev-zero": lambda p: p.symlink_to("/dev/zero"),
             "huge ids": lambda p: p.write_text(body([5, 6, 2**31], fp=fp)),
             "ids past the vocabulary": lambda p: p.write_text(body(toks + [past] * 4 + toks, fp=fp))}
    for name, make in cases.items():
        SC.folder().mkdir(parents=True, exist_ok=True)
        for p in (SC.path_for(fp), SC.static_path(fp)):
            if os.path.lexists(p):
                os.unlink(p)
        make(SC.path_for(fp))
        r = subprocess.run([sys.executable, "-m", "localspec", *run], capture_output=True, timeout=120,
                           env=environ({"PYTHONPATH": str(ROOT)}), preexec_fn=_limits)
        assert r.returncode == 0 and b"Traceback" not in r.stderr, (name, r.stderr.decode())
        for cmd in ("show", "clear"):
            r = cache_cli(cmd)
            assert r.returncode == 0 and b"Traceback" not in r.stderr, (name, cmd, r.stderr.decode())


# ------------------------------------------------------------------ cache build reads no link and no hidden file
def test_cache_build_follows_no_link_and_reads_no_hidden_file(target_path, tmp_path):
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "key.txt").write_text("the secret key text\n")
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("def f(x):\n    return x + 1\n")
    (src / "notes.md").write_text("the cat and the dog\n")
    (src / ".env").write_text("API_KEY=hunter2 and more\n")
    (src / ".config").mkdir()
    (src / ".config" / "x.txt").write_text("hidden folder text\n")
    (src / "pkg" / ".hidden.txt").write_text("hidden file text\n")
    (src / "link.txt").symlink_to(secret / "key.txt")
    (src / "linked").symlink_to(secret)
    (src / "pkg" / "up").symlink_to(src)
    os.mkfifo(src / "pipe.txt")
    r = cli(["cache", "build", str(src), "-m", str(target_path)], timeout=120)
    assert r.returncode == 0, r.stderr
    (path,) = SC.folder().glob("*.static.json")
    assert sorted(d["id"] for d in json.loads(path.read_bytes())["docs"]) == ["notes.md", "pkg/a.py"]
    r = cli(["cache", "build", str(src), "-m", str(target_path), "--glob", "*/*.py", "--glob", "linked/*"],
            timeout=120)
    assert r.returncode == 0, r.stderr
    assert [d["id"] for d in json.loads(path.read_bytes())["docs"]] == ["pkg/a.py"]


def test_cache_build_keeps_no_more_than_a_process_reads_back(target_path, tmp_path):
    (tmp_path / "a.txt").write_text("some text to draft from\n")
    most = SC.MIN_READ_BYTES // SC.BYTES_PER_TOKEN
    line = one_error_line(cli(["cache", "build", str(tmp_path), "-m", str(target_path), "--max-tokens",
                               str(most + 1)]))
    assert "--max-tokens" in line and str(most) in line
    assert cli(["cache", "build", str(tmp_path), "-m", str(target_path), "--max-tokens", str(most)]).returncode == 0


def test_cache_build_help_says_what_it_skips():
    r = cli(["cache", "build", "--help"], {"COLUMNS": "200"})
    assert r.returncode == 0
    text = " ".join(r.stdout.decode().split())
    assert "symbolic links" in text and "hidden" in text, text


# ------------------------------------------------------------------ the setting
def test_a_negative_suffix_cache_tokens_is_refused(tmp_path):
    line = one_error_line(cli(["config", "set", "suffix_cache_tokens", "--", "-1"]))
    assert "suffix_cache_tokens" in line and ">= 0" in line
    assert not (tmp_path / "cfg" / "config.toml").exists()
    line = one_error_line(cli(["cache", "show"], {"LOCALSPEC_SUFFIX_CACHE_TOKENS": "-5"}))
    assert "suffix_cache_tokens" in line
    (tmp_path / "cfg").mkdir(exist_ok=True)
    (tmp_path / "cfg" / "config.toml").write_text("suffix_cache_tokens = -1\n")
    line = one_error_line(cli(["config"]))
    assert "suffix_cache_tokens" in line and "config.toml" in line
    assert cli(["config", "unset", "suffix_cache_tokens"]).returncode == 0  # the repair
    assert cli(["config", "set", "suffix_cache_tokens", "0"]).returncode == 0


def test_cache_build_of_a_folder_name_the_file_system_refuses_is_one_error_line():
    for folder in ("a" * 5000, "~no-such-user-here/x"):
        line = one_error_line(cli(["cache", "build", folder]))
        assert len(line) < 500 and "OSError" not in line and "RuntimeError" not in line, line
