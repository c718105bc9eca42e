"""Chat history (localspec/store/history.py), the Markdown/JSON export, `localspec history ...` and resumed chats:
written as the chat happens, safe with two writers and a crash, readable from a read-only folder or a damaged row,
titles without terminal escapes, ids out of range and exports over special files refused in one line."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import cli, one_error_line
from localspec.errors import UsageError
from localspec.store import history as H
from localspec.store.exports import close_fences, open_fence, to_markdown
from localspec.store.history import History


def test_open_fence_follows_commonmark():
    assert open_fence("no code") is None
    assert open_fence("```python\nx = 1\n```\n") is None
    assert open_fence("```python\nx = 1\n") == "```"
    assert open_fence("````\n```\nstill code\n") == "````"  # a shorter fence does not close a longer one
    assert open_fence("~~~\n```\n") == "~~~"  # nor does the other character
    assert open_fence("```\ncode\n``` trailing\n") == "```"  # a closing fence has nothing after it
    assert open_fence("``` not `a` fence\n") is None  # a backtick info string cannot hold backticks
    assert open_fence("   ```\nindented 3 opens\n") == "```"


def test_close_fences_appends_the_matching_fence_only_when_open():
    assert close_fences("a ```inline``` b") == "a ```inline``` b"
    assert close_fences("```js\nlet x") == "```js\nlet x\n```"
    assert close_fences("~~~~\nx\n") == "~~~~\nx\n~~~~"
    md = to_markdown("t", [{"role": "assistant", "content": "```\nstopped", "state": "stopped"},
                           {"role": "user", "content": "next"}])
    assert open_fence(md) is None and "## assistant (stopped)" in md


# ---------------------------------------------------------------- the store
@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch):
    d = tmp_path / "data"
    monkeypatch.setenv("LOCALSPEC_DATA_DIR", str(d))
    monkeypatch.setenv("LOCALSPEC_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return d


def peek(path, sql, args=()):
    """Read the database the way another process would: a connection of its own."""
    db = sqlite3.connect(str(path))
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def test_chat_is_stored_as_it_happens_and_answers_are_throttled(monkeypatch):
    monkeypatch.setattr(H, "THROTTLE_S", 3600.0)  # only the token count triggers a write in this test
    store = History()
    assert store.path == H.db_path() and store.path.parent == Path(os.environ["LOCALSPEC_DATA_DIR"])
    assert peek(store.path, "PRAGMA journal_mode")[0][0] == "wal"
    cid = store.new_chat("  explain\n  decorators please  ", model="pair-x", system="be brief")
    store.add_message(cid, "user", "explain decorators please")
    w = store.answer(cid)
    content = lambda: peek(store.path, "SELECT content, state FROM messages WHERE role = 'assistant'")[0]
    assert content() == ("", "streaming")  # the answer's row exists from its first moment
    for i in range(H.THROTTLE_TOKENS - 1):
        w.append("x")
    assert content() == ("", "streaming")  # throttled: not every token is a write
    w.append("y")
    assert content() == ("x" * (H.THROTTLE_TOKENS - 1) + "y", "streaming")
    w.append("z")
    w.finish("final text", "done", {"tokens": 3})
    assert content() == ("final text", "done")
    c = store.get(cid)
    assert c.title == "explain decorators please" and c.model == "pair-x" and c.system == "be brief"
    assert [m["role"] for m in c.messages] == ["user", "assistant"] and c.messages[1]["stats"] == {"tokens": 3}
    assert store.latest() == cid and [x.id for x in store.chats()] == [cid]


def test_answers_are_also_written_every_half_second(monkeypatch):
    store = History()
    cid = store.new_chat("q")
    w = store.answer(cid)
    w.append("a")
    w.last_write -= H.THROTTLE_S  # as if half a second had passed since the last write
    w.append("b")
    assert peek(store.path, "SELECT content FROM messages WHERE id = ?", (w.message_id,))[0][0] == "ab"


def test_save_now_flushes_every_streaming_answer(monkeypatch):
    monkeypatch.setattr(H, "THROTTLE_S", 3600.0)
    store = History()
    w = store.answer(store.new_chat("q"))
    w.append("pending text")
    assert peek(store.path, "SELECT content FROM messages")[0][0] == ""
    assert H.save_now() >= 1
    assert peek(store.path, "SELECT content, state FROM messages")[0] == ("pending text", "streaming")


def test_rename_delete_and_unknown_ids():
    from localspec.errors import UsageError

    store = History()
    a, b = store.new_chat("first"), store.new_chat("second")
    store.add_message(a, "user", "first")
    store.rename(a, "  my   title ")
    assert store.get(a).title == "my title"
    with pytest.raises(UsageError, match="empty"):
        store.rename(a, "  ")
    store.delete(a)
    with pytest.raises(UsageError, match="no chat"):
        store.get(a)
    assert peek(store.path, "SELECT COUNT(*) FROM messages")[0][0] == 0  # its messages went with it
    with pytest.raises(UsageError, match="no chat"):
        store.delete(a)
    assert [c.id for c in store.chats()] == [b]


WRITER = textwrap.dedent("""
    import sys
    from localspec.store.history import History
    store = History()
    cid = store.new_chat("proc " + sys.argv[1])
    for i in range(int(sys.argv[2])):
        store.add_message(cid, "user", f"{sys.argv[1]}-{i}")
        w = store.answer(cid)
        w.append("x")
        w.finish(None, "done")
    print(cid)
""")


def test_two_processes_writing_at_once_lose_nothing(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    n = 150
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, name, str(n)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for name in ("a", "b")]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err.decode()
    path = H.db_path()
    assert peek(path, "PRAGMA integrity_check")[0][0] == "ok"
    for name, (out, _) in zip(("a", "b"), outs):
        cid = int(out)
        rows = peek(path, "SELECT content FROM messages WHERE chat_id = ? AND role = 'user' ORDER BY id", (cid,))
        assert [r[0] for r in rows] == [f"{name}-{i}" for i in range(n)]
        assert peek(path, "SELECT COUNT(*) FROM messages WHERE chat_id = ? AND state = 'done'", (cid,))[0][0] == 2 * n


CRASHER = textwrap.dedent("""
    import os
    from localspec.store.history import History
    store = History()
    cid = store.new_chat("crash")
    store.add_message(cid, "user", "tell me a story")
    w = store.answer(cid)
    for i in range(100):
        w.append(f"t{i} ")
    os.kill(os.getpid(), 9)  # no cleanup, no atexit: as a crash
""")


def test_a_crash_loses_at_most_the_last_moments_and_the_chat_is_offered_again():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    r = subprocess.run([sys.executable, "-c", CRASHER], env=env, capture_output=True, timeout=60)
    assert r.returncode == -9, r.stderr.decode()
    store = History()
    chat = store.get(store.latest())
    text = chat.messages[1]["content"]
    assert chat.messages[1]["state"] == "streaming"
    assert len(text.split()) >= 100 - H.THROTTLE_TOKENS and text.startswith("t0 t1 ")
    assert [c.id for c in store.interrupted()] == [chat.id]
    store.mark_interrupted(chat.id)  # told once
    assert store.interrupted() == []
    assert store.get(chat.id).messages[1]["state"] == "interrupted"
    assert store.get(chat.id).conversation()[1]["content"] == text  # a resumed chat keeps what was said


def test_an_answer_streaming_in_a_live_process_is_not_called_interrupted():
    store = History()
    cid = store.new_chat("mine")
    w = store.answer(cid)  # this process is alive
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        other = store.answer(cid)  # and one being written by another live process (a second chat window)
        store._write("UPDATE messages SET pid = ? WHERE id = ?", (sleeper.pid, other.message_id))
        assert store.interrupted() == []
        store.mark_interrupted(cid)  # e.g. the other window reopened this chat with --continue
        states = peek(store.path, "SELECT state FROM messages WHERE chat_id = ?", (cid,))
        assert states == [("streaming",), ("streaming",)]
    finally:
        sleeper.kill()
        sleeper.wait()
    assert [c.id for c in store.interrupted()] == [cid]  # its writer is gone now


def test_history_setting_is_a_bool_from_file_env_or_flag(tmp_path, monkeypatch):
    from localspec import settings as config
    from localspec.errors import UsageError

    assert config.values()["history"] is True
    for word, val in (("off", False), ("0", False), ("yes", True), ("TRUE", True)):
        monkeypatch.setenv("LOCALSPEC_HISTORY", word)
        assert config.values()["history"] is val
    monkeypatch.setenv("LOCALSPEC_HISTORY", "maybe")
    with pytest.raises(UsageError, match="history must be true or false"):
        config.values()
    monkeypatch.delenv("LOCALSPEC_HISTORY")
    cfg = tmp_path / "cfg"
    cfg.mkdir(exist_ok=True)
    (cfg / "config.toml").write_text("history = false\n")
    assert config.values()["history"] is False


# ---------------------------------------------------------------- `localspec history ...` and `chat` without a terminal
@pytest.fixture
def stored():
    store = History()
    a = store.new_chat("how do I reverse a list", model="pair-a")
    store.add_message(a, "user", "how do I reverse a list")
    w = store.answer(a)
    w.finish("Use slicing:\n\n```python\nxs[::-1]", "stopped")
    b = store.new_chat("second chat")
    store.add_message(b, "user", "second chat")
    store.close()
    return a, b


def test_history_list_show_export(stored, tmp_path):
    a, b = stored
    r = cli(["history", "list"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.decode().splitlines()
    assert lines[0].split() == ["id", "updated", "messages", "title", "model"]
    assert lines[1].split()[0] == str(b) and "how do I reverse a list" in lines[2]  # newest first
    rows = json.loads(cli(["history", "list", "--json"]).stdout)
    assert [(x["id"], x["messages"]) for x in rows] == [(b, 1), (a, 2)]
    show = cli(["history", "show", str(a)]).stdout.decode()
    assert "## assistant (stopped)" in show and show.rstrip().endswith("```")  # the open fence is closed
    out = tmp_path / "a.json"
    r = cli(["history", "export", str(a), "--format", "json", "-o", str(out)])
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["id"] == a and [m["state"] for m in data["messages"]] == ["done", "stopped"]


def test_history_export_never_overwrites_without_asking(stored, tmp_path):
    a, _ = stored
    out = tmp_path / "chat.md"
    out.write_text("my notes")
    line = one_error_line(cli(["history", "export", str(a), "-o", str(out)]), 2)
    assert "exists" in line and "--force" in line
    assert out.read_text() == "my notes"
    assert cli(["history", "export", str(a), "-o", str(out), "--force"]).returncode == 0
    assert "xs[::-1]" in out.read_text()
    one_error_line(cli(["history", "export", str(a), "--format", "html"]), 2)


def test_history_rm_asks_and_unknown_ids_are_one_error_line(stored):
    a, b = stored
    assert "--yes" in one_error_line(cli(["history", "rm", str(a)]), 2)
    assert History().get(a).id == a  # kept
    r = cli(["history", "rm", str(a), "--yes"])
    assert r.returncode == 0, r.stderr
    assert [c.id for c in History().chats()] == [b]
    assert "no chat" in one_error_line(cli(["history", "show", str(a)]), 2)
    assert "no chat" in one_error_line(cli(["history", "rm", "12345", "--yes"]), 2)


def test_history_list_on_a_fresh_machine_writes_nothing(data_dir):
    r = cli(["history", "list"])
    assert r.returncode == 0 and r.stdout == b"" and b"no stored chats" in r.stderr
    assert not data_dir.exists()


def test_chat_without_a_terminal_says_so_and_exits_2(data_dir):
    r = cli(["chat"], timeout=30)  # stdin is no terminal: chat must not wait on it
    assert "needs a terminal" in one_error_line(r, 2)
    assert not data_dir.exists()  # nothing stored either


def test_chat_continue_and_resume_errors(stored):
    a, b = stored
    assert "no chat 999" in one_error_line(cli(["chat", "--resume", "999"]), 2)
    assert "use one of them" in one_error_line(cli(["chat", "--continue", "--resume", str(a)]), 2)
    assert "history" in one_error_line(cli(["chat", "--continue", "--no-history"]), 2)
    # a valid --resume gets as far as the terminal check
    assert "needs a terminal" in one_error_line(cli(["chat", "--resume", str(a)]), 2)
    assert "needs a terminal" in one_error_line(cli(["chat", "--threads", "1", "--gpu-layers", "0",
                                                     "--draft-gpu-layers", "0", "--continue"]), 2)


def test_chat_continue_with_nothing_stored(data_dir):
    assert "no stored chat" in one_error_line(cli(["chat", "--continue"]), 2)


def test_chat_passes_runtime_flags_and_the_store_to_the_app(monkeypatch, stored):
    """`chat` takes run's runtime flags; with a terminal it opens the app on the session, the history and the
    chat to resume (the app itself is not run here)."""
    import localspec.tui.app as tui
    from localspec.cli import app as C

    a, b = stored
    seen = {}

    class FakeApp:
        def run(self):
            seen["ran"] = True

    def fake_create_app(sess, store=None, resume=None):
        seen.update(values=sess.values(), store=store, resume=resume)
        return FakeApp()

    monkeypatch.setattr(tui, "create_app", fake_create_app)
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    with pytest.raises(SystemExit) as e:
        C.main(["chat", "--threads", "1", "--gpu-layers", "3", "--draft-gpu-layers", "2", "--continue"])
    assert e.value.code == 0 and seen["ran"]
    v = seen["values"]
    assert (v["threads"], v["gpu_layers"], v["draft_gpu_layers"]) == (1, 3, 2)
    assert seen["resume"] == b and isinstance(seen["store"], History)
    with pytest.raises(SystemExit):
        C.main(["chat", "--no-history"])
    assert seen["store"] is None and seen["resume"] is None and seen["values"]["history"] is False
    monkeypatch.setenv("LOCALSPEC_HISTORY", "false")
    with pytest.raises(SystemExit) as e:
        C.main(["chat", "--resume", str(a)])
    assert e.value.code == 2


def test_a_locked_database_at_open_is_waited_for(tmp_path, monkeypatch):
    """An open that meets "database is locked" right away (switching a new file to WAL does not always wait on the
    busy timeout, so a second process opening at once can get it) retries until the busy timeout."""
    real_connect = sqlite3.connect
    failures = {"n": 2}

    class Flaky:
        def __init__(self, db):
            object.__setattr__(self, "_db", db)

        def __getattr__(self, name):
            return getattr(self._db, name)

        def __setattr__(self, name, value):
            setattr(self._db, name, value)

        def execute(self, sql, *args):
            if "journal_mode" in sql and failures["n"] > 0:
                failures["n"] -= 1
                raise sqlite3.OperationalError("database is locked")
            return self._db.execute(sql, *args)

    monkeypatch.setattr(H.sqlite3, "connect", lambda *a, **k: Flaky(real_connect(*a, **k)))
    store = H.History(tmp_path / "h.sqlite3")
    try:
        cid = store.new_chat("hello")
        assert store.get(cid).title == "hello" and failures["n"] == 0
    finally:
        store.close()


# ---------------------------------------------------------------- odd ids, special files, escapes, read-only and damaged stores
@pytest.mark.parametrize("cmd", ["show", "rm", "export"])
def test_history_id_out_of_range_is_a_usage_error(cmd):
    """`history show 99999999999999999999999` is a one-line usage error, not an OverflowError."""
    one_error_line(cli(["history", cmd, "99999999999999999999999"]), 2)


def test_history_export_refuses_a_fifo(data_dir):
    h = History()
    cid = h.new_chat("hello")
    h.add_message(cid, "user", "hello")
    h.close()
    fifo = data_dir.parent / "fifo"
    os.mkfifo(fifo)
    r = cli(["history", "export", str(cid), "-o", str(fifo), "--force"])
    one_error_line(r)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_history_titles_lose_control_characters():
    h = History()
    cid = h.new_chat("\x1b]0;pwned\x07\x1b[2J hi \x9b31m there")
    c = h.chats()[0]
    assert c.id == cid and "\x1b" not in c.title and "\x07" not in c.title and "\x9b" not in c.title
    assert "hi" in c.title and "there" in c.title
    h.rename(cid, "new \x1b[31mname")
    assert "\x1b" not in h.get(cid).title
    # a title stored with escapes (by hand, or by another writer) is cleaned when read
    h._db.execute("UPDATE chats SET title = ? WHERE id = ?", ("old \x1b[5m title", cid))
    assert "\x1b" not in h.chats()[0].title and "\x1b" not in h.get(cid).title
    h.close()
    r = cli(["history", "list"])
    assert r.returncode == 0 and b"\x1b[5m" not in r.stdout


def test_history_reads_a_read_only_data_dir():
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere: the read-only case cannot be made here")
    from localspec.store.history import data_dir

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


def test_history_read_only_database_file(data_dir):
    """As root the folder test cannot run: a read-only connection is used when the file cannot be written."""
    p = data_dir / "h.sqlite3"
    h = History(p)
    cid = h.new_chat("hello")
    h.add_message(cid, "user", "hello there")
    h.close()
    ro = History(p, readonly=True)
    assert ro.get(cid).messages[0]["content"] == "hello there" and ro.chats()[0].id == cid
    ro.close()


def test_damaged_stats_keeps_the_messages():
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
def test_history_huge_id_is_no_chat(cmd):
    History().close()
    line = one_error_line(cli(["history", cmd[0], "99999999999999999999999", *cmd[1:]]))
    assert "no chat" in line


def test_history_store_huge_and_negative_ids():
    h = History()
    for bad in (10 ** 30, -(10 ** 30)):
        for call in (h.get, h.delete, lambda i: h.rename(i, "t")):
            with pytest.raises(UsageError, match="no chat"):
                call(bad)
    h.close()
