"""Files localspec shares between its processes: JSON memos in the cache dir (verified checksums, exact-batch
probes), cross-process locks, and atomic writes (a temporary file in the same folder, renamed into place), so a
concurrent reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import stat
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import platformdirs
from filelock import FileLock, Timeout


def cache_dir() -> Path:
    return Path(os.environ.get("LOCALSPEC_CACHE_DIR") or platformdirs.user_cache_dir("localspec"))


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write `data` to `path` through a temporary file and a rename (the file is complete or absent). Only a
    regular file or a new path is written: a device node, pipe, socket or folder there is an OSError, never
    replaced. A symlink is followed (its target is replaced, the link kept: a config file linked from a dotfiles
    folder stays linked)."""
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(st.st_mode):
            kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise OSError(errno.EEXIST, f"{kind}: refusing to replace it (choose another path)", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _lock_path(name: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:80]
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    return cache_dir() / "locks" / f"{safe}-{digest}.lock"


@contextlib.contextmanager
def file_lock(name: str, waiting: str | None = None) -> Iterator[None]:
    """A lock shared by every localspec process of this user. When another process holds it, `waiting` is
    printed on stderr (once) and the call blocks until the lock is free."""
    path = _lock_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if waiting:
            sys.stderr.write(waiting + "\n")
            sys.stderr.flush()
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def read_json(name: str) -> dict:
    try:
        data = json.loads((cache_dir() / name).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def update_json(name: str, fn: Callable[[dict], None]) -> dict:
    """Read-modify-write a memo under a lock, so two processes adding entries keep both. Best effort: a read-only
    cache dir only costs a recomputation next time."""
    try:
        with file_lock(f"memo-{name}"):
            data = read_json(name)
            fn(data)
            atomic_write(cache_dir() / name, json.dumps(data))
            return data
    except OSError:
        data = read_json(name)
        fn(data)
        return data


def write_json(name: str, data: dict) -> None:
    """Replace a memo atomically (best effort, as update_json)."""
    update_json(name, lambda d: (d.clear(), d.update(data)))
