"""TOML files localspec owns (config.toml, pairs.toml): where they live, reading them with a clear error that says
how to repair them, and read-modify-write under a lock with an atomic replace. Written with tomli-w, so every
value localspec accepts (control characters, non-ASCII keys) reads back as it was stored."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

import platformdirs
import tomli_w

from localspec.errors import UsageError
from localspec.store.cachefile import atomic_write, file_lock


def config_dir() -> Path:
    return Path(os.environ.get("LOCALSPEC_CONFIG_DIR") or platformdirs.user_config_dir("localspec"))


def config_file() -> Path:
    return Path(os.environ.get("LOCALSPEC_CONFIG") or config_dir() / "config.toml")


def _read_text(path: Path) -> str | None:
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"config file {path} is a directory (LOCALSPEC_CONFIG must name a file)")
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as fh:
            return fh.read().decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"cannot read config file {path}: it is not UTF-8 text; edit or delete it") from None
    except OSError as exc:
        raise UsageError(f"cannot read config file {path}: {exc.strerror or exc}") from None


def load_toml(path: Path) -> dict:
    text = _read_text(path)
    if text is None:
        return {}
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(_unreadable(Path(path), text, exc)) from None


# ------------------------------------------------------------ a file that does not parse
_KEY_LINE = re.compile(r"""^\s*((?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*'))*)\s*=""")
_HEADER_LINE = re.compile(r"^\s*\[")
_AT_LINE = re.compile(r"at line (\d+)")


class _Broken:
    """Stands for an entry whose line did not parse, while an update decides whether it removes or replaces it."""

    def __repr__(self) -> str:
        return "<unreadable>"


def _key_path(key_text: str) -> tuple[str, ...] | None:
    try:
        d = tomllib.loads(f"{key_text} = 0")
    except tomllib.TOMLDecodeError:
        return None
    out = []
    while isinstance(d, dict) and len(d) == 1:
        k, d = next(iter(d.items()))
        out.append(k)
    return tuple(out)


def _table_path(lines: list[str], upto: int) -> tuple[str, ...] | None:
    """The table ([a.b] or [[a.b]]: None, not handled) that holds line `upto` (0-based)."""
    for i in range(upto - 1, -1, -1):
        line = lines[i]
        if _HEADER_LINE.match(line):
            if line.strip().startswith("[["):
                return None
            try:
                d = tomllib.loads(line)
            except tomllib.TOMLDecodeError:
                return None
            out = []
            while isinstance(d, dict) and len(d) == 1:
                k, d = next(iter(d.items()))
                out.append(k)
            return tuple(out)
    return ()


def salvage(text: str) -> tuple[dict, list[tuple[tuple[str, ...], int]]]:
    """What parses of a TOML text that does not: the entries whose lines fail are dropped, one at a time (at most
    20). Returns the data and, for each dropped entry, its full key path and its line (1-based). A ValueError when
    it cannot be salvaged so (the failing line belongs to no `key = value` entry)."""
    lines = text.split("\n")
    keep = list(range(len(lines)))
    dropped: list[tuple[tuple[str, ...], int]] = []
    for _ in range(20):
        try:
            return tomllib.loads("\n".join(lines[i] for i in keep)), dropped
        except tomllib.TOMLDecodeError as exc:
            m = _AT_LINE.search(str(exc))
            if not m:
                raise ValueError(str(exc)) from None
            pos = min(int(m.group(1)), len(keep)) - 1
            start = pos
            while start >= 0 and not _KEY_LINE.match(lines[keep[start]]):
                if _HEADER_LINE.match(lines[keep[start]]):
                    raise ValueError(str(exc)) from None
                start -= 1
            if start < 0:
                raise ValueError(str(exc)) from None
            first = keep[start]
            key = _key_path(_KEY_LINE.match(lines[first]).group(1))
            table = _table_path(lines, first)
            if key is None or table is None:
                raise ValueError(str(exc)) from None
            dropped.append((table + key, first + 1))
            del keep[start:pos + 1]
    raise ValueError("too many broken lines")


def _unreadable(path: Path, text: str, exc: Exception) -> str:
    msg = f"cannot read config file {path}: {exc}"
    try:
        _, dropped = salvage(text)
    except ValueError:
        return msg + "; edit or delete the file"
    settings = [".".join(k) for k, _ in dropped if len(k) == 1]
    where = ", ".join(f"`{'.'.join(k)}` (line {n})" for k, n in dropped)
    is_config = Path(path).resolve() == config_file().resolve()
    if is_config and settings and len(settings) == len(dropped):
        fix = " and ".join(f"`localspec config unset {s}`" for s in settings)
        return msg + f"; remove the broken setting with {fix}, or edit or delete the file"
    return msg + f"; fix or remove {where} in it, or delete the file"


def _strip_none(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _strip_none(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_strip_none(x) for x in v if x is not None]
    return v


def _has_broken(v: Any) -> bool:
    if isinstance(v, _Broken):
        return True
    if isinstance(v, dict):
        return any(_has_broken(x) for x in v.values())
    if isinstance(v, list):
        return any(_has_broken(x) for x in v)
    return False


def dumps_toml(data: dict) -> str:
    """TOML for what localspec stores (None values left out), written by tomli-w."""
    return tomli_w.dumps(_strip_none(data))


def update_file(path: Path, fn) -> dict:
    """Read-modify-write a TOML file under a cross-process lock, replaced atomically (the user's other keys are
    kept; a concurrent reader sees the old or the new file).

    A file that does not parse can still be repaired: the entries whose lines fail are set aside, and when `fn`
    removes or replaces every one of them (`config unset KEY`, `config set KEY VALUE`) the file is written without
    them; otherwise it is left as it is and the error says how to repair it."""
    with file_lock(f"config-{Path(path).resolve()}"):
        text = _read_text(path)
        try:
            data = {} if text is None else tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            try:
                data, dropped = salvage(text)
            except ValueError:
                raise UsageError(_unreadable(Path(path), text, exc)) from None
            for key, _ in dropped:
                d = data
                for k in key[:-1]:
                    d = d.setdefault(k, {})
                d[key[-1]] = _Broken()
            fn(data)
            if _has_broken(data):
                raise UsageError(_unreadable(Path(path), text, exc))
        else:
            fn(data)
        atomic_write(path, dumps_toml(data))
    return data
