"""The suffix drafter's corpus on disk: earlier prompts and answers, kept across sessions in the cache dir, and a
static corpus built from a folder of text or code (`localspec cache build`).

One JSON file per (vocabulary, scope): `suffix/<fingerprint>.json`, or `<fingerprint>-<scope>.json` for a server
with an API key, so tokens of another tokenizer are never read as this one's, and a client of one key never drafts
from another's text. A save merges under a file lock: it reads the file, adds or lengthens its documents by id, drops
the oldest beyond the size bound and replaces the file atomically (mode 0600), so processes saving at once keep each
other's documents. A file that does not parse is replaced on the next save, after one notice; never an error.
The static corpus is `suffix/<fingerprint>.static.json` in the same format, one document per file of the folder,
replaced whole by each build.

Only localspec's own files are touched: names of the patterns above in the `suffix` folder, which is never followed
where it is a symbolic link. A file there is read only where it is a regular file (not a link, pipe or device) and no
larger than a bound; a document is used only where its token ids are ids of the vocabulary. Anything else reads as
no cache, after one notice: never an error, never a hang. A link, pipe or folder at a cache file's name is never
written through or replaced; `cache clear` removes what has one of those names, except a folder, and nothing else.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import stat
import sys
from pathlib import Path
from typing import Callable, Iterator, Sequence

from localspec import defaults as D
from localspec.printable import printable
from localspec.store.cachefile import cache_dir, file_lock, lstat_at, open_folder, read_regular, write_at
from localspec.store.tomlfile import config_file, load_toml

FORMAT = 1
DEFAULT_TOKENS = D.SUFFIX_CACHE_TOKENS
# the most tokens a static cache keeps: every process that drafts with the suffix drafter indexes it on first use
# (~0.3 s and ~16 MB per 250k tokens)
STATIC_TOKENS = 250_000
SETTING_PERSIST = "suffix_cache"
SETTING_TOKENS = "suffix_cache_tokens"
MEMO = "vocab-fingerprints.json"
# a file's size bound: a stored token takes under 12 bytes (digits and a comma), and this leaves room for the ids
MIN_READ_BYTES = 64 << 20
BYTES_PER_TOKEN = 16
TOKEN_LIMIT = 2**31  # llama_token is a 32-bit int: an id beyond it fits no token array
# localspec's own names in the folder: <fingerprint>.json, <fingerprint>-<scope>.json, <fingerprint>.static.json, and
# the temporary files a save renames into place (write_at), left behind where a process was killed
OWN_NAME = re.compile(r"[0-9a-f]{32}(?:-[0-9a-f]{16}|\.static)?\.json")
OWN_TEMP = re.compile(r"\.([0-9a-f]{32}(?:-[0-9a-f]{16}|\.static)?\.json)\.[0-9a-f]{12}\.tmp")
_noticed: set[str] = set()  # files a notice was given for (once per process)
_VOCAB_SIZES: dict[str, int] = {}  # fingerprint -> vocabulary size, of the models this process fingerprinted


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
        key = None
    fp = read_json(MEMO).get(key) if key is not None else None
    if not isinstance(fp, str):
        fp = fingerprint(model.vocab_info())
        if key is not None:
            update_json(MEMO, lambda d: d.__setitem__(key, fp))
    n_vocab = getattr(model, "n_vocab", None)
    if isinstance(n_vocab, int) and n_vocab > 0:
        _VOCAB_SIZES[fp] = n_vocab  # a cache file's token ids are checked against it (_documents)
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
            then: str = "it is rebuilt from the next answers", what: str = "suffix cache") -> None:
    key = str(path)
    if key in _noticed:
        return
    _noticed.add(key)
    # the path comes from the environment and the disk: shown without its control characters (terminal escapes)
    msg = printable(f"note: the {what} {path} {why}; {then}")
    if say is not None:
        say(msg)
    else:
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()


def _folder_trouble(path: Path, exc: OSError, say) -> bool:
    """One notice for the folder where `exc` is about the folder of `path` (a link, not followed, or not a folder),
    not the file: every cache file in it shares the one cause. False where it is about the file."""
    if exc.filename is None or Path(exc.filename) != path.parent:
        return False
    _notice(path.parent, f"cannot be used ({exc.strerror or exc})", say,
            "earlier prompts and answers are neither read nor kept", what="suffix cache folder")
    return True


def _why(path: Path, exc: OSError) -> str:
    """The cause of `exc`, naming the path it concerns where that is not `path` (the lock, its folder)."""
    why = exc.strerror or str(exc)
    return why if exc.filename is None or Path(exc.filename) == path else f"{exc.filename}: {why}"


def read_bound(max_tokens: int) -> int:
    """The most bytes a cache file of `max_tokens` tokens is read up to; a larger one is not read."""
    return max(MIN_READ_BYTES, BYTES_PER_TOKEN * max(0, max_tokens))


def _documents(data, fp: str | None) -> list[dict] | None:
    """The documents of a parsed file (oldest first); None where it is another vocabulary's (fp None: any). A
    ValueError where it is not a suffix cache or a document is malformed: token ids must be ints in [0, 2^31) and,
    where this process knows the vocabulary's size, below it (an id past it would reach the model as a draft)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError("not a suffix cache")
    if fp is not None and data.get("vocab") != fp:
        return None  # another vocabulary's: never used
    docs = data.get("docs")
    if not isinstance(docs, list):
        raise ValueError("no document list")
    limit = min(TOKEN_LIMIT, _VOCAB_SIZES.get(data.get("vocab"), TOKEN_LIMIT)) if fp is not None else TOKEN_LIMIT
    for d in docs:
        if not isinstance(d, dict):
            raise ValueError("a document is malformed")
        toks, t = d.get("tokens"), d.get("t")
        if not (isinstance(d.get("id"), str) and type(t) in (int, float) and isinstance(toks, list)):
            raise ValueError("a document is malformed")
        try:
            if not math.isfinite(float(t)):
                raise ValueError("a document's time is not finite")
        except OverflowError:
            raise ValueError("a document's time is out of range") from None
        if not all(type(x) is int and 0 <= x < limit for x in toks):
            raise ValueError("a document holds a token id that is no token of the vocabulary")
    return docs


def _read(path: Path, fp: str | None, limit: int) -> list[dict] | None:
    """The documents of the file at `path` (_documents); FileNotFoundError where there is none; OSError where it
    cannot be read or is not a regular file; ValueError where it is damaged."""
    with open_folder(path.parent) as dfd:
        text, _ = read_regular(path.parent, dfd, path.name, limit)
    try:
        data = json.loads(text)
    except RecursionError:  # nested deeper than the parser goes
        raise ValueError("nested too deep") from None
    return _documents(data, fp)


def _parse(path: Path, fp: str, say, limit: int = MIN_READ_BYTES) -> list[dict] | None:
    """The file's documents (oldest first); None where there is no file, it is another vocabulary's or it cannot be
    read (a link, a pipe, a folder, too large). A damaged file gives one notice and reads as empty."""
    try:
        return _read(path, fp, limit)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if _folder_trouble(path, exc, say):
            return None
        if exc.errno == errno.EFBIG:  # a regular file of its own: replaced on the next save, as a damaged one
            _notice(path, f"is {exc.strerror}", say)
            return []
        _notice(path, f"cannot be read ({_why(path, exc)})", say, "it is not used")
        return None
    except (ValueError, TypeError):
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
        docs = _parse(self.path, self.fp, self.say, read_bound(self.max_tokens)) or []
        return [(d["id"], float(d["t"]), d["tokens"]) for d in docs]

    def save(self, docs: Sequence, replace: bool = False) -> bool:
        """Merge `docs` (objects with id, t, tokens) into the file (replace: they become its whole content): a
        document already there is kept in its longer version; the oldest are dropped beyond max_tokens. False where
        it could not be written."""
        try:
            with file_lock(f"suffix-{self.path.name}"):
                old = [] if replace else (_parse(self.path, self.fp, self.say, read_bound(self.max_tokens)) or [])
                merged = {d["id"]: (float(d["t"]), d["tokens"]) for d in old}
                for d in docs:
                    old = merged.get(d.id)
                    if old is None or len(d.tokens) >= len(old[1]):
                        merged[d.id] = (d.t if old is None else old[0], list(d.tokens))
                keep = bound(sorted(merged.items(), key=lambda kv: kv[1][0]), self.max_tokens)
                body = {"format": FORMAT, "vocab": self.fp,
                        "docs": [{"id": i, "t": t, "tokens": toks} for i, (t, toks) in keep]}
                # the folder is never followed where it is a link, the file never written through one (write_at:
                # a temporary file of mode 0600 renamed over it)
                with open_folder(self.path.parent, create=True) as dfd:
                    write_at(self.path.parent, dfd, self.path.name,
                             json.dumps(body, separators=(",", ":")).encode("utf-8"))
            return True
        except OSError as exc:
            if _folder_trouble(self.path, exc, self.say):
                return False
            _notice(self.path, f"cannot be written ({_why(self.path, exc)})", self.say,
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


def _scan() -> Iterator[tuple[int | None, os.DirEntry]]:
    """The open suffix folder and its entries (none where it is absent or a symbolic link: not followed)."""
    try:
        with open_folder(folder()) as dfd:
            with os.scandir(dfd if dfd is not None else folder()) as it:
                entries = sorted(it, key=lambda e: e.name)
            for e in entries:
                yield dfd, e
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a link (not followed) or a file: no cache files in it
            return
        raise


def folder_note() -> str | None:
    """Why the suffix folder is not used, where it is a symbolic link (None otherwise)."""
    if os.path.islink(folder()):
        return f"the suffix cache folder {folder()} is a symbolic link: not followed, nothing in it is read or deleted"
    return None


def files() -> list[tuple[Path, int, int, int]]:
    """(path, documents, tokens, bytes) of every suffix cache file (`localspec cache show`): localspec's own names,
    regular files only; a damaged one, or one over the size bound, counts 0 documents."""
    out = []
    limit = max(read_bound(STATIC_TOKENS), read_bound(configured()[1]))
    for dfd, e in _scan():
        if not OWN_NAME.fullmatch(e.name):
            continue
        path = folder() / e.name
        try:
            st = lstat_at(folder(), dfd, e.name)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        try:
            docs = _read(path, None, limit) or []
        except (OSError, ValueError, TypeError):
            docs = []
        out.append((path, len(docs), sum(len(d["tokens"]) for d in docs), st.st_size))
    return out


def clear() -> int:
    """Delete every suffix cache file (under each one's lock), and the temporary files of interrupted saves; returns
    how many were deleted. Only localspec's names in its own folder, and no folder: the entry itself is removed (a
    link, never what it points to)."""
    n = 0
    for dfd, e in _scan():
        own = OWN_NAME.fullmatch(e.name)
        temp = OWN_TEMP.fullmatch(e.name)
        if not (own or temp):
            continue
        with file_lock(f"suffix-{e.name if own else temp.group(1)}"):
            try:
                if stat.S_ISDIR(lstat_at(folder(), dfd, e.name).st_mode):
                    continue
                os.unlink(e.name if dfd is not None else folder() / e.name, dir_fd=dfd)
                n += 1
            except FileNotFoundError:
                pass
    return n
