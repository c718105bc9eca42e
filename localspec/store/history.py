"""Chat history: every chat stored as it happens, in SQLite (the standard library) under the user data dir.

One database file, `history.sqlite3` in platformdirs' user data dir (or $LOCALSPEC_DATA_DIR). WAL mode and a busy
timeout let two localspec processes write at once without corrupting it (SQLite locks the file; a writer waits for
the other instead of failing). A user message is stored when it is sent; an answer's row is created when it
starts and its text is rewritten as it streams (throttled: every THROTTLE_S seconds or THROTTLE_TOKENS pieces, and
at the end), so a crash loses at most the last moments of an answer. `save_now()` flushes every answer still
streaming in this process (for an abort handler that runs before the process dies; it also runs at exit).

Message states: done | stopped (the user stopped it) | streaming (being written; after a crash: interrupted) |
interrupted (a crashed answer the user has been told about) | error.
"""

from __future__ import annotations

import atexit
import json
import os
import sqlite3
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs

from localspec.errors import UsageError
from localspec.printable import printable

THROTTLE_S = 0.5
THROTTLE_TOKENS = 32
BUSY_TIMEOUT_S = 10.0
TITLE_CHARS = 60
SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS chats (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    model TEXT,
    system TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'done',
    pid INTEGER,
    stats TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_chat ON messages(chat_id, id);
CREATE INDEX IF NOT EXISTS chats_updated ON chats(updated);
"""


def data_dir() -> Path:
    return Path(os.environ.get("LOCALSPEC_DATA_DIR") or platformdirs.user_data_dir("localspec"))


def db_path() -> Path:
    return data_dir() / "history.sqlite3"


def clean_title(text: str) -> str:
    """One line without control characters (ESC, BEL, C1 controls such as CSI): a title is printed on terminals,
    and a chat's first words must not be able to drive them."""
    return " ".join(printable(text).split())


def title_from(text: str) -> str:
    line = clean_title(text)
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"


MAX_ID = 2 ** 63 - 1  # SQLite's INTEGER


def _no_chat(chat_id) -> UsageError:
    return UsageError(f"no chat {chat_id} in the history (`localspec history list` shows them)")


def _check_id(chat_id: int) -> int:
    """A chat id SQLite can hold; any other number names no chat (not an OverflowError)."""
    if isinstance(chat_id, bool) or not isinstance(chat_id, int) or not -MAX_ID - 1 <= chat_id <= MAX_ID:
        raise _no_chat(chat_id)
    return chat_id


def _stats(raw) -> dict | None:
    """A message's stored stats, or None when the row is damaged (the message itself is kept)."""
    if not raw:
        return None
    try:
        v = json.loads(raw)
    except (TypeError, ValueError):
        return None
    return v if isinstance(v, dict) else None


@dataclass
class Chat:
    id: int
    title: str
    model: str | None
    system: str | None
    created: float
    updated: float
    n_messages: int = 0
    messages: list[dict] = field(default_factory=list)  # {"role", "content", "state"}

    def conversation(self) -> list[dict]:
        """The messages as the chat template sees them: failed answers left out, interrupted ones kept."""
        return [{"role": m["role"], "content": m["content"]} for m in self.messages if m["state"] != "error"]

    def to_dict(self) -> dict:
        return {"id": self.id, "title": self.title, "model": self.model, "system": self.system,
                "created": self.created, "updated": self.updated,
                "messages": [{"role": m["role"], "content": m["content"], "state": m["state"],
                              **({"stats": m["stats"]} if m.get("stats") else {})} for m in self.messages]}


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process with that id: not ours, so our writer is gone
        return False
    except OSError:
        return False
    return True


class History:
    """The history database. Thread-safe: one connection, guarded by a lock (an abort handler may flush from
    another thread while the UI thread writes)."""

    def __init__(self, path: Path | None = None, readonly: bool | None = None) -> None:
        """`readonly`: open for reading only (list, show, export); None: when the database or its folder cannot
        be written (a read-only data dir), else read-write."""
        self.path = Path(path) if path is not None else db_path()
        self._db = None
        if readonly is None:
            readonly = str(self.path) != ":memory:" and self.path.is_file() and not (
                os.access(self.path, os.W_OK) and os.access(self.path.parent, os.W_OK))
        self.readonly = readonly
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        pause = 0.02
        while True:
            try:
                self._open_readonly() if self.readonly else self._open()
                break
            except sqlite3.OperationalError as exc:
                if not self.readonly and "readonly" in str(exc) and self.path.is_file():
                    # a read-only file system (root passes os.access): reads still work
                    if self._db is not None:
                        self._db.close()
                        self._db = None
                    self.readonly = True
                    continue
                # another process is creating the file or switching it to WAL: SQLite can answer "locked" at once
                # there instead of waiting on the busy timeout, so wait and open again
                if self._db is not None:
                    self._db.close()
                    self._db = None
                transient = "locked" in str(exc) or "busy" in str(exc)
                if not transient or time.monotonic() > deadline:
                    raise UsageError(f"cannot open the chat history {self.path}: {exc}") from None
                time.sleep(pause)
                pause = min(pause * 2, 0.5)
            except sqlite3.DatabaseError as exc:
                raise UsageError(f"cannot open the chat history {self.path}: {exc}") from None
            except OSError as exc:
                raise UsageError(f"cannot open the chat history {self.path}: {exc.strerror or exc}") from None
        self._lock = threading.RLock()

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_S, check_same_thread=False,
                                   isolation_level=None)  # autocommit; explicit transactions below
        self._db.row_factory = sqlite3.Row
        self._db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        if self._db.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":  # persistent once set
            self._db.execute("PRAGMA journal_mode = WAL")
        self._db.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: a crashed process loses nothing committed
        self._db.execute("PRAGMA foreign_keys = ON")
        with self._tx():
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise UsageError(f"history database {self.path} is from a newer localspec (schema {version})")
            if version == 0:
                for stmt in SCHEMA.split(";"):  # not executescript: it would commit the transaction
                    if stmt.strip():
                        self._db.execute(stmt)
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _open_readonly(self) -> None:
        """A read-only connection: nothing is created or migrated. In a folder that cannot be written SQLite
        cannot make WAL's shared-memory file, so the database is then read as immutable (no other writer can
        exist there)."""
        from urllib.parse import quote

        uri = "file:" + quote(str(self.path.resolve()))
        last: Exception | None = None
        for mode in ("?mode=ro", "?mode=ro&immutable=1"):
            try:
                self._db = sqlite3.connect(uri + mode, uri=True, timeout=BUSY_TIMEOUT_S, check_same_thread=False,
                                           isolation_level=None)
                self._db.row_factory = sqlite3.Row
                version = self._db.execute("PRAGMA user_version").fetchone()[0]
                self._db.execute("SELECT 1 FROM chats LIMIT 1").fetchall()
                break
            except sqlite3.OperationalError as exc:
                last = exc
                if self._db is not None:
                    self._db.close()
                    self._db = None
        else:
            raise last
        if version > SCHEMA_VERSION:
            raise UsageError(f"history database {self.path} is from a newer localspec (schema {version})")

    # ------------------------------------------------------------ plumbing
    class _Tx:
        def __init__(self, db: sqlite3.Connection) -> None:
            self.db = db

        def __enter__(self):
            self.db.execute("BEGIN IMMEDIATE")  # take the write lock now (waits up to the busy timeout)
            return self.db

        def __exit__(self, typ, exc, tb):
            self.db.execute("COMMIT" if typ is None else "ROLLBACK")

    def _tx(self) -> "_Tx":
        return History._Tx(self._db)

    def _write(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self._lock:
            try:
                with self._tx() as db:
                    return db.execute(sql, args)
            except sqlite3.DatabaseError as exc:
                raise UsageError(f"cannot write the chat history {self.path}: {exc}") from None

    def _read(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.DatabaseError as exc:
                raise UsageError(f"cannot read the chat history {self.path}: {exc}") from None

    def close(self) -> None:
        save_now()
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------ chats
    def new_chat(self, first_message: str, model: str | None = None, system: str | None = None) -> int:
        now = time.time()
        cur = self._write("INSERT INTO chats (title, model, system, created, updated) VALUES (?, ?, ?, ?, ?)",
                          (title_from(first_message) or "untitled", model, system, now, now))
        return int(cur.lastrowid)

    def set_chat_settings(self, chat_id: int, model: str | None, system: str | None) -> None:
        self._write("UPDATE chats SET model = ?, system = ? WHERE id = ?", (model, system, chat_id))

    def rename(self, chat_id: int, title: str) -> None:
        _check_id(chat_id)
        title = clean_title(title)
        if not title:
            raise UsageError("a chat title cannot be empty")
        if self._write("UPDATE chats SET title = ? WHERE id = ?", (title, chat_id)).rowcount == 0:
            raise UsageError(f"no chat {chat_id} in the history")

    def delete(self, chat_id: int) -> None:
        _check_id(chat_id)
        if self._write("DELETE FROM chats WHERE id = ?", (chat_id,)).rowcount == 0:
            raise UsageError(f"no chat {chat_id} in the history")

    def chats(self, limit: int | None = None) -> list[Chat]:
        """Newest first."""
        rows = self._read(
            "SELECT c.*, (SELECT COUNT(*) FROM messages m WHERE m.chat_id = c.id) AS n FROM chats c "
            "ORDER BY c.updated DESC, c.id DESC" + (f" LIMIT {int(limit)}" if limit else ""))
        return [Chat(r["id"], clean_title(r["title"] or ""), r["model"], r["system"], r["created"], r["updated"], r["n"])
                for r in rows]

    def latest(self) -> int | None:
        rows = self._read("SELECT id FROM chats ORDER BY updated DESC, id DESC LIMIT 1")
        return rows[0]["id"] if rows else None

    def get(self, chat_id: int) -> Chat:
        _check_id(chat_id)
        rows = self._read("SELECT * FROM chats WHERE id = ?", (chat_id,))
        if not rows:
            raise _no_chat(chat_id)
        r = rows[0]
        msgs = [{"role": m["role"], "content": m["content"], "state": m["state"], "stats": _stats(m["stats"])}
                for m in self._read("SELECT * FROM messages WHERE chat_id = ? ORDER BY id", (chat_id,))]
        return Chat(r["id"], clean_title(r["title"] or ""), r["model"], r["system"], r["created"], r["updated"],
                    len(msgs), msgs)

    def interrupted(self) -> list[Chat]:
        """Chats whose answer was still streaming when its process died (newest first)."""
        rows = self._read("SELECT DISTINCT chat_id, pid FROM messages WHERE state = 'streaming'")
        ids = sorted({r["chat_id"] for r in rows if not _pid_alive(r["pid"])})
        return [c for c in self.chats() if c.id in ids]

    def mark_interrupted(self, chat_id: int) -> None:
        """The user was told about this chat's crashed answers: they are not offered again. An answer another
        live process is still writing is left alone."""
        _check_id(chat_id)
        rows = self._read("SELECT id, pid FROM messages WHERE chat_id = ? AND state = 'streaming'", (chat_id,))
        for r in rows:
            if not _pid_alive(r["pid"]):
                self._write("UPDATE messages SET state = 'interrupted' WHERE id = ? AND state = 'streaming'", (r["id"],))

    # ------------------------------------------------------------ messages
    def add_message(self, chat_id: int, role: str, content: str, state: str = "done") -> int:
        now = time.time()
        with self._lock:
            try:
                with self._tx() as db:
                    cur = db.execute(
                        "INSERT INTO messages (chat_id, role, content, state, pid, created, updated) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?)", (chat_id, role, content, state, os.getpid(), now, now))
                    db.execute("UPDATE chats SET updated = ? WHERE id = ?", (now, chat_id))
                    return int(cur.lastrowid)
            except sqlite3.DatabaseError as exc:
                raise UsageError(f"cannot write the chat history {self.path}: {exc}") from None

    def update_message(self, message_id: int, content: str, state: str | None = None,
                       stats: dict[str, Any] | None = None) -> None:
        now = time.time()
        sets, args = ["content = ?", "updated = ?"], [content, now]
        if state is not None:
            sets.append("state = ?")
            args.append(state)
        if stats is not None:
            sets.append("stats = ?")
            args.append(json.dumps(stats))
        self._write(f"UPDATE messages SET {', '.join(sets)} WHERE id = ?", (*args, message_id))

    def answer(self, chat_id: int) -> "AnswerWriter":
        """Start storing an assistant answer that is about to stream."""
        return AnswerWriter(self, chat_id, self.add_message(chat_id, "assistant", "", state="streaming"))


class AnswerWriter:
    """An answer as it streams: appended text is written at most every THROTTLE_S seconds or THROTTLE_TOKENS
    pieces; `flush()` writes what is pending now; `finish()` writes the final text and state."""

    def __init__(self, store: History, chat_id: int, message_id: int) -> None:
        self.store, self.chat_id, self.message_id = store, chat_id, message_id
        self.text = ""
        self.pending = 0
        self.last_write = time.monotonic()
        self.closed = False
        self._lock = threading.Lock()
        _register(self)

    def append(self, piece: str) -> None:
        with self._lock:
            if self.closed:
                return
            self.text += piece
            self.pending += 1
            due = self.pending >= THROTTLE_TOKENS or time.monotonic() - self.last_write >= THROTTLE_S
        if due:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            if self.closed or not self.pending:
                return
            self.store.update_message(self.message_id, self.text)
            self.pending = 0
            self.last_write = time.monotonic()

    def finish(self, text: str | None = None, state: str = "done", stats: dict | None = None) -> None:
        with self._lock:
            if self.closed:
                return
            if text is not None:
                self.text = text
            self.store.update_message(self.message_id, self.text, state=state, stats=stats)
            self.closed = True
        _unregister(self)


# ---------------------------------------------------------------- flushing before the process dies
_open: "weakref.WeakSet[AnswerWriter]" = weakref.WeakSet()
_open_lock = threading.Lock()
_atexit_registered = False


def _register(w: AnswerWriter) -> None:
    global _atexit_registered
    with _open_lock:
        _open.add(w)
        if not _atexit_registered:
            atexit.register(save_now)
            _atexit_registered = True


def _unregister(w: AnswerWriter) -> None:
    with _open_lock:
        _open.discard(w)


def save_now() -> int:
    """Write every answer still streaming in this process to the history now (they stay marked as streaming, so
    if the process then dies they are offered again as interrupted). Safe from any thread; never raises.
    Returns how many answers were flushed."""
    with _open_lock:
        writers = list(_open)
    n = 0
    for w in writers:
        try:
            w.flush()
            n += 1
        except Exception:  # pragma: no cover - best effort on the way down
            pass
    return n


def open_history(enabled: bool = True) -> History | None:
    return History() if enabled else None
