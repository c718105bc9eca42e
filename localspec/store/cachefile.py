"""Files localspec shares between its processes: JSON memos in the cache dir (verified checksums, exact-batch
probes), cross-process locks, and atomic writes (a temporary file in the same folder, renamed into place), so a
concurrent reader sees the old file or the new one, never half of one.

Files in the cache dir are read and written as files of localspec's own: a read opens no symbolic link, pipe or
device and stops at a size bound (a pipe would block the reader, /dev/zero would fill its memory), and a write goes
through no symbolic link, at the file or at its folder (it would replace a file outside the cache dir)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import stat
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import platformdirs
from filelock import FileLock, Timeout

MEMO_BYTES = 64 << 20  # the most a memo read takes in: memos hold a few entries per model file
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_BINARY = getattr(os, "O_BINARY", 0)
# the calls relative to an open folder: where the platform has them, a folder swapped for a link mid-way is not
# followed either (elsewhere the folder's path is checked, then used)
_AT = {os.open, os.stat, os.unlink, os.rename} <= os.supports_dir_fd and os.scandir in os.supports_fd


def cache_dir() -> Path:
    return Path(os.environ.get("LOCALSPEC_CACHE_DIR") or platformdirs.user_cache_dir("localspec"))


def _refusal(code: int, why: str, path) -> OSError:
    return OSError(code, why, str(path))


@contextlib.contextmanager
def open_folder(path: Path, create: bool = False, follow: bool = False) -> Iterator[int | None]:
    """A descriptor of the folder `path` (None where the platform has no calls relative to one), for the calls below.
    Unless `follow` (the cache dir itself, which the user may place anywhere), the folder must not be a symbolic
    link: the cache dir's sub-folders are localspec's own, and one linked elsewhere (into a project) would have that
    folder's files read, replaced or deleted. FileNotFoundError where it is absent and not `create`d."""
    path = Path(path)
    if create:
        path.mkdir(parents=True, exist_ok=True)
    if not follow and os.path.islink(path):
        raise _refusal(errno.ELOOP, "a symbolic link, not followed", path)
    if not _AT:
        if not path.is_dir():
            raise _refusal(errno.ENOTDIR, "not a folder", path) if path.exists() else FileNotFoundError(
                errno.ENOENT, "no such folder", str(path))
        yield None
        return
    try:
        fd = os.open(path, os.O_RDONLY | _DIRECTORY | (0 if follow else _NOFOLLOW) | _CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise _refusal(errno.ELOOP, "a symbolic link, not followed", path) from None
        raise
    try:
        yield fd
    finally:
        os.close(fd)


def _at(folder: Path, dfd: int | None, name: str):
    return name if dfd is not None else str(Path(folder) / name)


def lstat_at(folder: Path, dfd: int | None, name: str) -> os.stat_result:
    return os.stat(_at(folder, dfd, name), dir_fd=dfd, follow_symlinks=False)


def read_regular(folder: Path, dfd: int | None, name: str, limit: int) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file `name` in an open folder (open_folder), and its stat. An OSError, never a hang,
    for a symbolic link (not followed), a pipe, device or folder (never opened for reading), or a file over `limit`
    bytes (not read)."""
    path = Path(folder) / name
    st = lstat_at(folder, dfd, name)
    if stat.S_ISLNK(st.st_mode):
        raise _refusal(errno.ELOOP, "a symbolic link, not followed", path)
    if not stat.S_ISREG(st.st_mode):
        raise _refusal(errno.EINVAL, "not a regular file", path)
    # O_NONBLOCK: a pipe put there between the check and the open does not block the open
    fd = os.open(_at(folder, dfd, name), os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC | _BINARY, dir_fd=dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refusal(errno.EINVAL, "not a regular file", path)
        if st.st_size > limit:
            raise _refusal(errno.EFBIG, f"too large ({st.st_size} bytes, at most {limit} read)", path)
        chunks, n = [], 0
        while n <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - n))
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
        if n > limit:
            raise _refusal(errno.EFBIG, f"too large (over {limit} bytes)", path)
        return b"".join(chunks), st
    finally:
        os.close(fd)


def write_at(folder: Path, dfd: int | None, name: str, data: bytes) -> None:
    """Replace the file `name` in an open folder (open_folder) atomically: a temporary file of mode 0600 created
    there (never through a link), renamed over it. A symbolic link, pipe, device or folder at `name` is an OSError
    and stays as it is: the file is written only where it is a regular file or absent."""
    path = Path(folder) / name
    try:
        st = lstat_at(folder, dfd, name)
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISLNK(st.st_mode):
            raise _refusal(errno.ELOOP, "a symbolic link: refusing to write through it", path)
        if not stat.S_ISREG(st.st_mode):
            kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise _refusal(errno.EEXIST, f"{kind}: refusing to replace it", path)
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(_at(folder, dfd, tmp), os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC | _BINARY, 0o600,
                 dir_fd=dfd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(_at(folder, dfd, tmp), _at(folder, dfd, name), src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(_at(folder, dfd, tmp), dir_fd=dfd)
        raise


def atomic_write(path: Path, data: str | bytes, *, follow_symlinks: bool = True) -> None:
    """Write `data` to `path` through a temporary file and a rename (the file is complete or absent). Only a
    regular file or a new path is written: a device node, pipe, socket or folder there is an OSError, never
    replaced. follow_symlinks: a symlink is followed (its target is replaced, the link kept: a config file linked
    from a dotfiles folder stays linked); else a link at the path is an OSError (write_at), as for the cache dir's
    own files."""
    path = Path(path)
    if not follow_symlinks:
        with open_folder(path.parent, create=True, follow=True) as dfd:
            write_at(path.parent, dfd, path.name, data.encode("utf-8") if isinstance(data, str) else data)
        return
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
    # a lock file is created and written: never in a folder a link leads to, never through a link at its name
    with open_folder(path.parent, create=True) as dfd:
        try:
            if stat.S_ISLNK(lstat_at(path.parent, dfd, path.name).st_mode):
                raise _refusal(errno.ELOOP, "a symbolic link: refusing to lock through it", path)
        except FileNotFoundError:
            pass
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
    """A memo ({} where it is absent, damaged, nested past the parser's depth, too large or not a regular file)."""
    try:
        with open_folder(cache_dir(), follow=True) as dfd:
            text, _ = read_regular(cache_dir(), dfd, name, MEMO_BYTES)
        data = json.loads(text)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError, RecursionError):
        return {}


def update_json(name: str, fn: Callable[[dict], None]) -> dict:
    """Read-modify-write a memo under a lock, so two processes adding entries keep both. Best effort: a read-only
    cache dir only costs a recomputation next time."""
    try:
        with file_lock(f"memo-{name}"):
            data = read_json(name)
            fn(data)
            atomic_write(cache_dir() / name, json.dumps(data), follow_symlinks=False)
            return data
    except OSError:
        data = read_json(name)
        fn(data)
        return data


def write_json(name: str, data: dict) -> None:
    """Replace a memo atomically (best effort, as update_json)."""
    update_json(name, lambda d: (d.clear(), d.update(data)))
