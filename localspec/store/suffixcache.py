"""The suffix drafter's corpus on disk: earlier prompts and answers, kept across sessions in the cache dir, and a
static corpus built from a folder of text or code (`localspec cache build`).

One JSON file per (vocabulary, scope): `suffix/<fingerprint>.json`, or `<fingerprint>-<scope>.json` for a server
with an API key, so tokens of another tokenizer are never read as this one's, and a client of one key never drafts
from another's text. A save merges under a file lock: it reads the file, adds or lengthens its documents by id, drops
the oldest beyond the size bound and replaces the file atomically (mode 0600), so processes saving at once keep each
other's documents. A file that does not parse is replaced on the next save, after one notice; never an error.
The static corpus is `suffix/<fingerprint>.static.json` in the same format, one document per file of the folder,
replaced whole by each build.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from localspec import defaults as D
from localspec.store.cachefile import atomic_write, cache_dir, file_lock
from localspec.store.tomlfile import config_file, load_toml

FORMAT = 1
DEFAULT_TOKENS = D.SUFFIX_CACHE_TOKENS
# the most tokens a static cache keeps: every process that drafts with the suffix drafter indexes it on first use
# (~0.3 s and ~16 MB per 250k tokens)
STATIC_TOKENS = 250_000
SETTING_PERSIST = "suffix_cache"
SETTING_TOKENS = "suffix_cache_tokens"
MEMO = "vocab-fingerprints.json"
_noticed: set[str] = set()  # files a notice was given for (once per process)


def folder() -> Path:
    return cache_dir() / "suffix"


def fingerprint(info) -> str:
    """A vocabulary's identity (llama.vocab.VocabInfo): its kind, size, special tokens and every token's text. Two
    models share a cache only when the same ids mean the same text."""
    h = hashlib.sha256(f"{info.vocab_type}|{info.n_vocab}|{info.bos}|{info.eos}|{info.add_bos}|{info.add_eos}"
                       .encode())
    texts = info.token_text
    for i in range(info.n_vocab):
        t = texts[i] or b""
        h.update(len(t).to_bytes(4, "little"))
        h.update(t)
    return h.hexdigest()[:32]


def model_fingerprint(model) -> str:
    """fingerprint() of a loaded model's vocabulary, remembered per model file (path, size and modification time,
    as the exactness probes key a file): reading 150k token texts takes a few tenths of a second."""
    from localspec.store.cachefile import read_json, update_json

    path = getattr(model, "path", None)
    try:
        st = Path(path).stat()
        key = f"{Path(path).resolve()}|{st.st_size}|{st.st_mtime_ns}"
    except (OSError, TypeError):
        return fingerprint(model.vocab_info())
    fp = read_json(MEMO).get(key)
    if not isinstance(fp, str):
        fp = fingerprint(model.vocab_info())
        update_json(MEMO, lambda d: d.__setitem__(key, fp))
    return fp


def scope_of(api_key: str | None) -> str:
    """The cache scope of a server's API key ("" without one: the user's own, shared with `run` and `chat`). A
    digest, so the key itself is written nowhere."""
    if not api_key:
        return ""
    return hashlib.sha256(b"localspec suffix cache scope\0" + api_key.encode()).hexdigest()[:16]


def path_for(fp: str, scope: str = "") -> Path:
    return folder() / (f"{fp}-{scope}.json" if scope else f"{fp}.json")


def static_path(fp: str) -> Path:
    """The static cache of a vocabulary (built from a folder by `localspec cache build`)."""
    return folder() / f"{fp}.static.json"


def is_static(path: Path) -> bool:
    return path.name.endswith(".static.json")


def configured() -> tuple[bool, int]:
    """(persist, most tokens kept) from the settings `suffix_cache` and `suffix_cache_tokens` (config file, then
    LOCALSPEC_SUFFIX_CACHE / LOCALSPEC_SUFFIX_CACHE_TOKENS, as settings.resolve ranks them). The front ends check
    both settings before any model loads (settings.py); a value they would refuse reads as the default here."""
    try:
        data = load_toml(config_file())
    except Exception:  # a broken config file is the front end's error to report
        data = {}
    raw = {k.replace("-", "_"): v for k, v in data.items()}
    for key in (SETTING_PERSIST, SETTING_TOKENS):
        env = os.environ.get(f"LOCALSPEC_{key.upper()}", "")
        if env != "":
            raw[key] = env
    persist = raw.get(SETTING_PERSIST, True)
    if not isinstance(persist, bool):
        word = str(persist).strip().lower()
        persist = word not in ("0", "false", "no", "off")
    try:
        tokens = int(raw.get(SETTING_TOKENS, DEFAULT_TOKENS))
    except (TypeError, ValueError):
        tokens = DEFAULT_TOKENS
    return persist, max(0, tokens)


def _notice(path: Path, why: str, say: Callable[[str], None] | None,
            then: str = "it is rebuilt from the next answers") -> None:
    key = str(path)
    if key in _noticed:
        return
    _noticed.add(key)
    msg = f"note: the suffix cache {path} {why}; {then}"
    if say is not None:
        say(msg)
    else:
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()


def _parse(path: Path, fp: str, say) -> list[dict] | None:
    """The file's documents (oldest first); None where there is no file or it is another vocabulary's. A damaged
    file gives one notice and reads as empty."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        _notice(path, f"cannot be read ({exc.strerror or exc})", say, "it is not used")
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError("not a suffix cache")
        if data.get("vocab") != fp:
            return None  # another vocabulary's: never used
        docs = data["docs"]
        if not isinstance(docs, list):
            raise ValueError("no document list")
        out = []
        for d in docs:
            toks = d["tokens"]
            if not (isinstance(d.get("id"), str) and isinstance(d.get("t"), (int, float)) and isinstance(toks, list)
                    and all(type(t) is int and t >= 0 for t in toks)):
                raise ValueError("a document is malformed")
            out.append(d)
        return out
    except (ValueError, KeyError, TypeError, AttributeError):
        _notice(path, "is damaged", say)
        return []


class SuffixFile:
    """The persisted corpus of one vocabulary and scope. `load` and `save` never raise: a cache that cannot be read
    or written only costs speed (one notice, through `say` or stderr)."""

    def __init__(self, fp: str, scope: str = "", max_tokens: int = DEFAULT_TOKENS,
                 say: Callable[[str], None] | None = None, path: Path | None = None) -> None:
        self.fp = fp
        self.scope = scope
        self.max_tokens = max_tokens
        self.say = say
        self.path = path if path is not None else path_for(fp, scope)

    def load(self) -> list[tuple[str, float, list[int]]]:
        """(id, time, tokens) of the stored documents, oldest first."""
        docs = _parse(self.path, self.fp, self.say) or []
        return [(d["id"], float(d["t"]), d["tokens"]) for d in docs]

    def save(self, docs: Sequence, replace: bool = False) -> bool:
        """Merge `docs` (objects with id, t, tokens) into the file (replace: they become its whole content): a
        document already there is kept in its longer version; the oldest are dropped beyond max_tokens. False where
        it could not be written."""
        try:
            with file_lock(f"suffix-{self.path.name}"):
                old = [] if replace else (_parse(self.path, self.fp, self.say) or [])
                merged = {d["id"]: (float(d["t"]), d["tokens"]) for d in old}
                for d in docs:
                    old = merged.get(d.id)
                    if old is None or len(d.tokens) >= len(old[1]):
                        merged[d.id] = (d.t if old is None else old[0], list(d.tokens))
                keep = bound(sorted(merged.items(), key=lambda kv: kv[1][0]), self.max_tokens)
                body = {"format": FORMAT, "vocab": self.fp,
                        "docs": [{"id": i, "t": t, "tokens": toks} for i, (t, toks) in keep]}
                atomic_write(self.path, json.dumps(body, separators=(",", ":")))
                os.chmod(self.path, 0o600)
            return True
        except OSError as exc:
            _notice(self.path, f"cannot be written ({exc.strerror or exc})", self.say,
                    "answers are kept within this process only")
            return False


def bound(docs: list, max_tokens: int) -> list:
    """The newest documents (id, (t, tokens)) whose tokens add up to at most max_tokens, oldest first (a document
    longer than the bound keeps its last max_tokens)."""
    keep, total = [], 0
    for i, (t, toks) in reversed(docs):
        if total + len(toks) > max_tokens:
            if not keep and max_tokens > 0:
                keep.append((i, (t, toks[-max_tokens:])))
            break
        keep.append((i, (t, toks)))
        total += len(toks)
    return keep[::-1]


def files() -> list[tuple[Path, int, int]]:
    """(path, documents, tokens) of every suffix cache file (`localspec cache show`); a damaged one counts 0."""
    out = []
    for p in sorted(folder().glob("*.json")) if folder().is_dir() else []:
        try:
            data = json.loads(p.read_bytes())
            docs = data.get("docs", []) if isinstance(data, dict) else []
            n_tok = sum(len(d.get("tokens", [])) for d in docs if isinstance(d, dict))
            out.append((p, len(docs), n_tok))
        except (OSError, ValueError, TypeError, AttributeError):
            out.append((p, 0, 0))
    return out


def clear() -> int:
    """Delete every suffix cache file (under each one's lock); returns how many were deleted."""
    n = 0
    for p, _, _ in files():
        with file_lock(f"suffix-{p.name}"):
            try:
                p.unlink()
                n += 1
            except FileNotFoundError:
                pass
    return n
