"""User settings: defaults < config file (TOML, platformdirs) < LOCALSPEC_* environment < flags. The session layer
(session.py) adds the pair's defaults and stored tune results between the built-in defaults and the file."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

import platformdirs

from .errors import UsageError

# key: (type, default, help)
SETTINGS: dict[str, tuple[type, Any, str]] = {
    "model": (str, "qwen2.5-coder-1.5b", "pair name, hub model (OWNER/REPO[:QUANT], hf://…) or target GGUF path"),
    "draft": (str, None, "draft: hub model, GGUF path or pair name"),
    "method": (str, "auto", "auto | draft | lookup | none"),
    "exactness": (str, "auto", "bit (output identical to one-token decoding; k capped) | lossless (k uncapped; only "
                               "float reduction order differs) | auto (bit when the cap leaves >= 2 draft tokens)"),
    "draft_tokens": (int, None, "k: draft tokens per step (default: the pair's k, else 4; auto: the most it may use)"),
    "p_min": (float, 0.75, "draft model stops drafting when its top probability falls below this"),
    "lookup_min": (int, 2, "shortest n-gram prompt lookup matches"),
    "lookup_max": (int, 4, "longest n-gram prompt lookup matches"),
    "max_tokens": (int, 512, "most tokens to generate"),
    "temperature": (float, 0.0, "0 = greedy"),
    "top_k": (int, 0, "0 = off"),
    "top_p": (float, 1.0, "1 = off"),
    "min_p": (float, 0.0, "0 = off"),
    "seed": (int, None, "sampling seed (default: random)"),
    "ctx_size": (int, 4096, "context size in tokens"),
    "gpu_layers": (int, None, "target layers offloaded to the GPU (-1 = all; default: all when llama.cpp has a GPU, else 0)"),
    "draft_gpu_layers": (int, None, "draft layers offloaded to the GPU (-1 = all; default: all when llama.cpp has a GPU, else 0)"),
    "threads": (int, None, "CPU threads (default: all cores)"),
    "rpc": (str, None, "llama.cpp RPC workers HOST:PORT[,HOST:PORT...] that hold the target's layers (draft stays local)"),
    "tensor_split": (str, None, "share of the target's layers per device with rpc, e.g. 3,1 (default: by free memory)"),
    "system": (str, None, "system prompt"),
    "history": (bool, True, "store chats in the history (`localspec history`); false: nothing is stored"),
}

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


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


def coerce(key: str, value: Any, source: str) -> Any:
    typ = SETTINGS[key][0]
    if value is None:
        return None
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            word = str(value).strip().lower()
            if word in TRUE_WORDS or word in FALSE_WORDS:
                return word in TRUE_WORDS
            raise ValueError(word)
        if typ is float:
            v = float(value)
            if math.isnan(v):
                raise ValueError("NaN")
            return v
        if typ is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        return str(value)
    except (TypeError, ValueError):
        kind = "true or false" if typ is bool else f"a {typ.__name__}"
        raise UsageError(f"{source}: {key} must be {kind}, got {value!r}") from None


@dataclass
class Setting:
    value: Any
    source: str  # default | file | env | flag


def resolve(flags: dict[str, Any] | None = None) -> dict[str, Setting]:
    """Effective settings with where each came from."""
    out = {k: Setting(d, "default") for k, (_, d, _) in SETTINGS.items()}
    path = config_file()
    data = load_toml(path)
    for k, v in data.items():
        key = k.replace("-", "_")
        if key in SETTINGS:
            out[key] = Setting(coerce(key, v, str(path)), f"file {path}")
    for key in SETTINGS:
        env = f"LOCALSPEC_{key.upper()}"
        if os.environ.get(env, "") != "":
            out[key] = Setting(coerce(key, os.environ[env], env), f"env {env}")
    for key, v in (flags or {}).items():
        if v is not None and key in SETTINGS:
            out[key] = Setting(v, "flag")
    return out


def values(flags: dict[str, Any] | None = None) -> dict[str, Any]:
    return {k: s.value for k, s in resolve(flags).items()}


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
    from .cachefile import atomic_write, file_lock

    with file_lock(f"config-{Path(path).resolve()}"):
        data = load_toml(path)
        fn(data)
        atomic_write(path, dumps_toml(data))
    return data
