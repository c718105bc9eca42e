"""Where a model file comes from: a hub repo + file (with mirrors, sha256, size) or a local path.

Hub names are checked as the hub checks them wherever they enter (a FileSpec is made from a command line, from
pairs.toml or models.toml, or from the cache): a repo is OWNER/NAME, a file or revision is a relative path of
plain segments (no `..`, `.` or empty segments, no absolute part, no backslash, no control character), so nothing
derived from them can name a file outside localspec's caches."""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from localspec.errors import UsageError
from localspec.printable import has_control as _has_control

# huggingface_hub's validate_repo_id: word characters, '-', '.'; starts and ends with a word character; no '--'
# or '..'; at most 96 characters
_REPO_PART = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")


SHOWN = 200  # characters of a name an error line quotes whole; a longer one is cut
NAME_MAX = 255  # bytes in one part of a path, on the file systems localspec runs on
PATH_MAX = 4095  # bytes in a whole path


def shown(name) -> str:
    """A name or path as an error line quotes it: one longer than SHOWN cut to its start and end (a path's file name),
    with its length, so that the line stays one readable line whatever was passed."""
    s = str(name)
    return s if len(s) <= SHOWN else f"{s[:60]}...{s[-40:]} ({len(s)} characters)"


def _nbytes(s: str) -> int:
    return len(s.encode("utf-8", "surrogateescape"))


def too_long(path: str) -> bool:
    """Longer than any file system here can look up: a part over NAME_MAX bytes, or the whole over PATH_MAX."""
    return _nbytes(path) > PATH_MAX or any(_nbytes(part) > NAME_MAX for part in path.split("/"))


TOO_LONG = f"too long for a file name or path (a part holds at most {NAME_MAX} bytes, a path {PATH_MAX + 1})"


def bad_name(name, exc: OSError) -> UsageError:
    """The usage error for a name the file system refused to look up (too long, not a valid name, no access)."""
    if exc.errno == errno.ENAMETOOLONG:
        return UsageError(f"{shown(name)}: {TOO_LONG}")
    return UsageError(f"cannot look up {shown(name)}: {exc.strerror or exc}")


def user_path(s: str) -> Path:
    """`s` as a path, `~` and `~USER` expanded. A `~USER` that names no user is a UsageError (pathlib would raise
    RuntimeError, and leaving it as written would name a folder called `~USER`)."""
    p = os.path.expanduser(s)
    if s.startswith("~") and p == s:
        user = s[1:].split("/", 1)[0]
        raise UsageError(f"cannot expand {shown(s)}: there is no user {shown(user)!r} on this machine"
                         if user else f"cannot expand {shown(s)}: no home folder is known")
    return Path(p)


def is_file(p, name=None) -> bool:
    """Whether `p` is a file. A name the file system refuses to look up (too long, no access) is a UsageError naming
    `name` (default: p): what was typed is wrong, not the machine, and pathlib raises OSError for it."""
    try:
        return Path(p).is_file()
    except OSError as exc:
        raise bad_name(p if name is None else name, exc) from None


def is_dir(p, name=None) -> bool:
    """Whether `p` is a folder; a name the file system refuses to look up is a UsageError, as for is_file."""
    try:
        return Path(p).is_dir()
    except OSError as exc:
        raise bad_name(p if name is None else name, exc) from None


def check_repo(repo: str) -> str:
    """`repo` when it is a valid OWNER/NAME hub repo id, else a UsageError."""
    parts = repo.split("/") if isinstance(repo, str) else []
    if (len(parts) != 2 or not all(_REPO_PART.fullmatch(p) for p in parts) or "--" in repo or ".." in repo
            or len(repo) > 96):
        raise UsageError(f"invalid hub repo {shown(repo)!r}: expected OWNER/NAME (letters, digits, '-', '_', '.'; "
                         "no '--' or '..')")
    return repo


def check_relpath(value: str, what: str = "file") -> str:
    """`value` when it is a relative path of plain segments, as the hub names files (and branches), else a
    UsageError: no `..` or `.` segment, no empty segment, no absolute part, no backslash, no control character."""
    why = None
    if not isinstance(value, str) or not value:
        why = "it is empty"
    elif _has_control(value):
        why = "it contains a control character"
    elif "\\" in value:
        why = "it contains a backslash"
    elif value.startswith("/") or re.match(r"^[A-Za-z]:", value):
        why = "it is an absolute path"
    else:
        segs = value.split("/")
        if any(s in ("", ".", "..") for s in segs):
            why = "a hub path has no '..', '.' or empty parts"
        elif too_long(value):  # it names a file in the caches
            why = f"it is {TOO_LONG}"
    if why:
        raise UsageError(f"invalid hub {what} name {shown(value)!r}: {why}")
    return value


def check_gguf_file(p: Path, name: str | None = None) -> Path:
    """`p` when it starts with the GGUF magic, else a UsageError (a pair's local file must be a model)."""
    try:
        with open(p, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise UsageError(f"cannot read {shown(name or p)}: {exc.strerror or exc}") from None
    if magic != b"GGUF":
        raise UsageError(f"{shown(name or p)} is not a GGUF model file (it does not start with the GGUF magic)")
    return p


@dataclass
class FileSpec:
    repo: str | None = None
    file: str | None = None
    revision: str | None = None
    sha256: str | None = None
    size: int | None = None
    mirrors: list[dict] = field(default_factory=list)
    path: str | None = None  # a local file (user pairs)

    def __post_init__(self) -> None:
        if self.path is not None:
            if not isinstance(self.path, str) or not self.path or "\x00" in self.path:
                raise UsageError(f"invalid model path {shown(self.path)!r}")
            if too_long(self.path):
                raise UsageError(f"model path {shown(self.path)}: {TOO_LONG}")
            return
        if self.repo is not None or self.file is not None:
            if self.repo is None or self.file is None:
                raise UsageError(f"a hub file needs both repo and file, got repo={self.repo!r} file={self.file!r}")
            check_repo(self.repo)
            check_relpath(self.file, "file")
        if self.revision is not None:
            check_relpath(self.revision, "revision")

    @classmethod
    def from_dict(cls, d: dict) -> "FileSpec":
        if not isinstance(d, dict):
            raise TypeError(f"expected a table, got {type(d).__name__}")
        mirrors = d.get("mirrors", [])
        if not isinstance(mirrors, list) or not all(isinstance(m, dict) for m in mirrors):
            raise TypeError("mirrors must be a list of tables")
        vals = {k: d.get(k) for k in ("repo", "file", "revision", "sha256", "path")}
        for k, v in vals.items():
            if v is not None and not isinstance(v, str):
                raise TypeError(f"{k} must be a string, got {v!r}")
        size = d.get("size")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int)):
            raise TypeError(f"size must be an integer, got {size!r}")
        return cls(**vals, size=size, mirrors=list(mirrors))

    @classmethod
    def parse(cls, src: str) -> "FileSpec":
        """`hf://owner/repo/file.gguf[@revision]` or a local path."""
        if src.startswith("hf://"):
            rest = src[5:]
            rev = None
            if "@" in rest:
                rest, rev = rest.rsplit("@", 1)
            parts = rest.split("/")
            if len(parts) < 3 or not parts[-1]:
                raise UsageError(f"expected hf://OWNER/REPO/FILE.gguf, got {shown(src)}")
            return cls(repo="/".join(parts[:2]), file="/".join(parts[2:]), revision=rev)
        p = user_path(src)
        if not is_file(p, src):
            raise UsageError(f"no such file: {shown(src)}")
        check_gguf_file(p, src)
        return cls(path=str(p.resolve()))

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("repo", "file", "revision", "sha256", "size", "path") if getattr(self, k) is not None}
        if self.mirrors:
            d["mirrors"] = self.mirrors
        return d

    @property
    def label(self) -> str:
        return self.path or f"{self.repo}/{self.file}"
