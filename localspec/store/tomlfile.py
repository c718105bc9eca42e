"""TOML files localspec owns (config.toml, pairs.toml): where they live, reading them with a clear error, and
read-modify-write under a lock with an atomic replace."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

import platformdirs

from localspec.errors import UsageError
from localspec.store.cachefile import atomic_write, file_lock


def config_dir() -> Path:
    return Path(os.environ.get("LOCALSPEC_CONFIG_DIR") or platformdirs.user_config_dir("localspec"))


def config_file() -> Path:
    return Path(os.environ.get("LOCALSPEC_CONFIG") or config_dir() / "config.toml")


def load_toml(path: Path) -> dict:
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"config file {path} is a directory (LOCALSPEC_CONFIG must name a file)")
    if not path.is_file():
        return {}
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except UnicodeDecodeError:
        raise UsageError(f"cannot read config file {path}: it is not UTF-8 text") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"cannot read config file {path}: {exc}") from None


# ------------------------------------------------------------ writing TOML
def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_fmt(x)}" for k, x in v.items() if x is not None) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else _fmt(k)


def dumps_toml(data: dict, prefix: str = "") -> str:
    """Small TOML writer for what localspec stores: scalars, lists, inline dicts in lists, nested tables."""
    lines = [f"{_key(k)} = {_fmt(v)}" for k, v in data.items() if v is not None and not isinstance(v, dict)]
    for k, v in data.items():
        if isinstance(v, dict):
            name = f"{prefix}.{_key(k)}" if prefix else _key(k)
            lines += ["", f"[{name}]", dumps_toml(v, name).rstrip()]
    return "\n".join(lines).strip() + "\n"


def update_file(path: Path, fn) -> dict:
    """Read-modify-write a TOML file under a cross-process lock, replaced atomically (the user's other keys are
    kept; a concurrent reader sees the old or the new file)."""
    with file_lock(f"config-{Path(path).resolve()}"):
        data = load_toml(path)
        fn(data)
        atomic_write(path, dumps_toml(data))
    return data
