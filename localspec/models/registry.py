"""Model pairs: the shipped models.toml plus the user's own pairs (user config dir, pairs.toml)."""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from localspec.store import tomlfile as config
from localspec import defaults as D
from localspec.errors import UsageError
from localspec.models.spec import FileSpec, is_file, shown, user_path


@dataclass
class Pair:
    name: str
    description: str
    target: FileSpec
    draft: FileSpec | None
    k: int = D.DRAFT_TOKENS
    ctx: int = D.CTX_SIZE
    source: str = "shipped"


def shipped_file() -> Path:
    return Path(str(resources.files("localspec") / "data" / "models.toml"))


def user_pairs_file() -> Path:
    return config.config_dir() / "pairs.toml"


def _int_field(d: dict, key: str, default: int, where: str) -> int:
    v = d.get(key, default)
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    try:
        if isinstance(v, str) or (isinstance(v, float) and v.is_integer()):
            return int(v)  # "4" and 4.0 were read as 4 before: still are
    except ValueError:
        pass
    raise UsageError(f"{where}: {key} must be an integer, got {v!r}")


def _pairs_from(data: dict, source: str) -> dict[str, Pair]:
    """The pairs of one file; a malformed entry is a UsageError naming the file, the pair and the key."""
    out = {}
    table = data.get("pairs") or {}
    if not isinstance(table, dict):
        raise UsageError(f"pairs in {source} must be a table of pairs, got {table!r}")
    for name, d in table.items():
        where = f"pair {name!r} in {source}"
        if not isinstance(d, dict):
            raise UsageError(f"{where} is malformed: expected a table, got {d!r}")
        try:
            description = d.get("description", "")
            if not isinstance(description, str):
                raise UsageError(f"{where}: description must be a string, got {description!r}")
            if "target" not in d:
                raise UsageError(f"{where} is malformed: it has no target")
            specs = {}
            for role in ("target", "draft"):
                if not d.get(role):
                    continue
                try:
                    specs[role] = FileSpec.from_dict(d[role])
                except (UsageError, TypeError) as exc:
                    raise UsageError(f"{where}: {role}: {exc}") from None
            out[name] = Pair(
                name=name,
                description=description,
                target=specs["target"] if "target" in specs else FileSpec.from_dict(d["target"]),
                draft=specs.get("draft"),
                k=_int_field(d, "k", 4, where),
                ctx=_int_field(d, "ctx", D.CTX_SIZE, where),
                source=source,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise UsageError(f"{where} is malformed: {exc}") from None
    return out


def load() -> tuple[dict[str, Pair], str]:
    shipped = config.load_toml(shipped_file())
    pairs = _pairs_from(shipped, "shipped")
    pairs.update(_pairs_from(config.load_toml(user_pairs_file()), f"user {user_pairs_file()}"))
    return pairs, shipped.get("default", next(iter(pairs)))


def close_names(name: str, names: list[str], n: int = 3) -> list[str]:
    """The names a mistyped `name` may have meant: those difflib finds close (its default cutoff, so an unrelated
    name suggests nothing), then those that begin with it (`smol` for smollm2-...)."""
    close = difflib.get_close_matches(name, names, n=n, cutoff=0.6)
    if len(name) >= 3:
        close += [p for p in names if p.startswith(name) and p not in close]
    return close[:n]


def get(name: str) -> Pair:
    pairs, _ = load()
    if name in pairs:
        return pairs[name]
    close = close_names(name, list(pairs))
    hint = (f"; did you mean {', '.join(close)}?" if close
            else "; see `localspec models list`, or name a hub model as OWNER/REPO[:QUANT]")
    raise UsageError(f"unknown model pair {shown(name)!r}{hint}")


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_name(name: str) -> None:
    """Pair names: letters, digits, '.', '-', '_', starting with a letter or digit, at most 64 characters, and not
    ending in .gguf: anything else would be read by -m as a path or a hub name (OWNER/REPO:QUANT)."""
    if not NAME.fullmatch(name) or name.lower().endswith(".gguf"):
        raise UsageError(
            f"invalid pair name {shown(name)!r}: use letters, digits, '.', '-' and '_', starting with a letter or digit, "
            "at most 64 characters, not ending in .gguf"
        )


def add(name: str, target: FileSpec, draft: FileSpec | None, k: int = D.DRAFT_TOKENS, ctx: int = D.CTX_SIZE, description: str = "") -> Path:
    check_name(name)
    shipped, _ = _pairs_from(config.load_toml(shipped_file()), "shipped"), None
    if name in shipped:
        raise UsageError(f"{name!r} is a shipped pair; choose another name")

    def upd(data):
        entry = {"description": description or f"user pair {name}", "k": k, "ctx": ctx, "target": target.to_dict()}
        if draft is not None:
            entry["draft"] = draft.to_dict()
        data.setdefault("pairs", {})[name] = entry

    path = user_pairs_file()
    config.update_file(path, upd)
    return path


def remove(name: str) -> Path:
    """Delete a user pair's entry from pairs.toml (its files are the caller's business)."""
    if name in _pairs_from(config.load_toml(shipped_file()), "shipped"):
        raise UsageError(f"{name!r} is a shipped pair: it cannot be removed, only its downloaded files deleted")

    def upd(data):
        if name not in (data.get("pairs") or {}):
            get(name)  # unknown: the usual error with suggestions
            raise UsageError(f"{name!r} is not in {user_pairs_file()}")
        del data["pairs"][name]

    path = user_pairs_file()
    config.update_file(path, upd)
    return path


def looks_like_path(s: str) -> bool:
    """An existing file, or a name written as a path (not as a hub name such as OWNER/REPO:QUANT)."""
    from localspec.models import hubname as hfname

    if is_file(user_path(s), s):
        return True
    if hfname.is_hub_name(s):
        return False
    return s.endswith(".gguf") or os.sep in s or "/" in s or s.startswith((".", "~"))


def resolve_name(s: str):
    """What a -m/-d value names: ("path", Path), ("pair", Pair) or ("hub", HubName). An existing file is a path, and
    so is ollama:NAME[:TAG] (the blob in Ollama's store, models/local.py);
    a pair name wins over a hub name; `A/B` that is neither is a hub repo; anything else written like a path is a
    (missing) path, and the rest an unknown pair name (UsageError with suggestions). A name the file system cannot
    look up (too long, a `~USER` that names no user) is a UsageError here, the one place every -m/-d passes."""
    from localspec.models import hubname as hfname
    from localspec.models import local

    p = user_path(s)
    if is_file(p, s):
        return "path", p
    if local.is_ollama_name(s):  # ollama:NAME[:TAG], read where Ollama keeps it
        return "path", local.ollama_path(s)
    pairs, _ = load()
    if s in pairs:
        return "pair", pairs[s]
    hub = hfname.parse(s)
    if hub is not None:
        return "hub", hub
    if looks_like_path(s):
        return "path", p
    return "pair", get(s)
