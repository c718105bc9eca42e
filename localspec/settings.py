"""User settings: defaults < config file (TOML, platformdirs) < LOCALSPEC_* environment < flags. The session layer
(session.py) adds the pair's defaults and stored tune results between the built-in defaults and the file."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from localspec import defaults as D
from localspec.errors import UsageError
from localspec.store.tomlfile import config_dir, config_file, load_toml, update_file  # noqa: F401 - re-exported for front ends

# key: (type, default, help)
SETTINGS: dict[str, tuple[type, Any, str]] = {
    "model": (str, "qwen2.5-coder-1.5b", "pair name, hub model (OWNER/REPO[:QUANT], hf://…) or target GGUF path"),
    "draft": (str, None, "draft: hub model, GGUF path or pair name"),
    "method": (str, D.METHOD, " | ".join(D.METHODS)),
    "exactness": (str, D.EXACTNESS_LEVEL, "bit (output identical to one-token decoding; k capped) | lossless (k uncapped; only "
                               "float reduction order differs) | auto (bit when the cap leaves >= 2 draft tokens)"),
    "draft_tokens": (int, None, "k: draft tokens per step (default: the pair's k, else 4; auto: the most it may use, 2x at most 8 where it repeats earlier text)"),
    "p_min": (float, D.P_MIN, "draft model stops drafting when its top probability falls below this"),
    "lookup_min": (int, D.LOOKUP_MIN, "shortest n-gram prompt lookup matches"),
    "lookup_max": (int, D.LOOKUP_MAX, "longest n-gram prompt lookup matches"),
    "max_tokens": (int, D.MAX_TOKENS, "most tokens to generate"),
    "temperature": (float, 0.0, "0 = greedy"),
    "top_k": (int, 0, "0 = off"),
    "top_p": (float, 1.0, "1 = off"),
    "min_p": (float, 0.0, "0 = off"),
    "seed": (int, None, "sampling seed (default: random)"),
    "ctx_size": (int, D.CTX_SIZE, "context size in tokens"),
    "gpu_layers": (int, None, "target layers offloaded to the GPU (-1 = all; default: all when llama.cpp has a GPU, else 0)"),
    "draft_gpu_layers": (int, None, "draft layers offloaded to the GPU (-1 = all; default: all when llama.cpp has a GPU, else 0)"),
    "threads": (int, None, "CPU threads (default: all cores)"),
    "rpc": (str, None, "llama.cpp RPC workers HOST:PORT[,HOST:PORT...] that hold the target's layers (draft stays local)"),
    "tensor_split": (str, None, "share of the target's layers per device with rpc, e.g. 3,1 (default: by free memory)"),
    "system": (str, None, "system prompt"),
    "history": (bool, True, "store chats in the history (`localspec history`); false: nothing is stored"),
    "suffix_cache": (bool, True, "keep earlier prompts and answers for the suffix drafter across sessions, in the cache "
                                 "dir (`localspec cache`); false: within a process only"),
    "suffix_cache_tokens": (int, D.SUFFIX_CACHE_TOKENS, "most tokens the suffix cache keeps (oldest requests dropped "
                                                        "first; 0 = no cache)"),
    "prompt_cache": (bool, True, "keep the KV state of long prompts' prefixes on disk, so a later run or chat with the "
                                 "same start restores it instead of decoding it (`localspec cache`)"),
    "prompt_cache_bytes": (int, D.PROMPT_CACHE_BYTES, "disk budget of the prompt cache in bytes (least recently used "
                                                      "states deleted first; 0 = none kept)"),
}

# the least value of a whole-number setting, checked wherever it is read (config file, environment, `config set`), so
# a stored value cannot mean something else in each place that reads it
MINIMUM = {"suffix_cache_tokens": 0, "prompt_cache_bytes": 0}

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


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
            n = int(value)
            if key in MINIMUM and n < MINIMUM[key]:
                raise UsageError(f"{source}: {key} must be a whole number >= {MINIMUM[key]}, got {n}")
            return n
        if key in _CHECKS:
            _check(key, str(value), source)
        return str(value)
    except (TypeError, ValueError):
        kind = {bool: "true or false", int: "a whole number", float: "a number"}.get(typ, "text")
        raise UsageError(f"{source}: {key} must be {kind}, got {value!r}") from None


def _check(key: str, value: str, source: str) -> None:
    """A per-setting check, as `run` applies it, so a stored value cannot fail every later run."""
    from localspec import rpcwire as protocol

    try:
        _CHECKS[key](protocol)(value)
    except UsageError as exc:
        why = str(exc)
        for flag in ("--rpc", "--tensor-split"):
            why = why.replace(f"{flag}: ", "").replace(flag, key)
        raise UsageError(f"{source}: {key} {value!r}: {why}") from None


_CHECKS = {"rpc": lambda p: p.parse_servers, "tensor_split": lambda p: p.parse_tensor_split}


def tuned_results() -> dict:
    """Stored tune results ({model key: {setting: value}}) from the config file's [tuned] table. A broken entry
    is ignored (a `tuned` that is not a table, an entry that is not one), as docs/run.md promises."""
    tuned = load_toml(config_file()).get("tuned")
    if not isinstance(tuned, dict):
        return {}
    return {k: v for k, v in tuned.items() if isinstance(v, dict)}


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
