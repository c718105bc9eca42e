"""Prompt states: the KV cache of a prompt's prefix, kept in memory and on disk, so that a later request or a later
process that starts with the same tokens restores it instead of decoding them again (a prefill of thousands of
tokens takes seconds on a CPU; reading its state back takes a fraction of that).

What a state is: `Model.state_bytes()` of a plain transformer (rollback kind "kv"), the KV rows of exactly the
tokens stored beside it, which `Model.restore_state(tokens, data)` puts back. The bytes are llama.cpp's serialization
of values computed by one model file's weights, on one build's kernels, in one KV type. So a state is keyed
(`state_key`) by everything that changes those bytes or their layout, and is never returned for another key:
- the model file: its resolved path, size, modification time and a digest of its first and last MiB (a file
  replaced at the same path, even with its size and time kept, is another model);
- the llama.cpp build and CPU: the version, llama_print_system_info's features and backends, the CPU's flags (a
  rebuild with other kernels, or a cache dir shared with another machine, computes other values);
- where the layers run: GPU layers, RPC workers and their split, and LOCALSPEC_NO_REPACK (other kernels again);
- the KV type (bf16, f16, q8_0: another layout, which llama.cpp also refuses);
- the threads: one-token decodes over more than 512 f16 cells split the attention across threads, so the KV rows
  of tokens decoded one at a time (an answer that becomes the next prompt) depend on their number. These are the
  settings the exactness probes are keyed by: a state is reused exactly where a probe's answer is;
- the batch size (n_batch): a prompt's KV rows depend on the passes they were decoded in, and a state is kept only
  for a prefix decoded in whole n_batch chunks from position 0, as a cold prefill decodes it (core/prompt_cache.py).
Not keyed: the context size (a state fits a context or llama.cpp refuses it, and restore_state reports False), the
drafter and the sampling settings (they change no KV row).

The prefix index is by chained hashes of fixed blocks of BLOCK tokens, as llama-server's and vLLM's prefix caches
are: h_0 = H(key), h_i = H(h_{i-1}, block_i). A state of n = i * BLOCK tokens is the file named by h_i, so the
longest stored prefix of a prompt is found by looking up h_m, h_{m-1}, ... (a name per block, no index file to keep
consistent between processes), and a hash chain that starts at the key never names another key's state. A state is
stored only for a block-aligned prefix (`aligned(n)`: the caller saves the state there), and only from MIN_TOKENS on:
a short prefix is cheaper to decode than to read.

A file is `MAGIC`, a little-endian u32 version and u32 header length, a JSON header (key digest, token count,
payload size, sha256, the model's file name for `cache show`), the tokens as little-endian int32, then the payload;
the sha256 covers the key digest, the tokens and the payload. Before its bytes are returned, a file must be a
regular file of localspec's name pattern, name the same key, hold exactly the asked prefix's tokens and match its
digest. Anything else is skipped: a truncated, bit-flipped or foreign file at one of the names is removed (it is
localspec's own regular file), a symbolic link, pipe or device there is neither read, followed nor removed, and no
read raises or hangs.

The disk store is bounded (`budget` bytes, 4 GiB by default): after each store, under a lock shared by every
localspec process, the least recently used states (by modification time, which a hit refreshes) are deleted until
the rest fit, so processes storing at once leave a store of whole files within the budget. Writes are atomic
(cachefile.write_at: mode 0600, in the 0700 folder `prompt-states` of the cache dir, never through a link), so a
reader sees a whole file or none. `MemoryStates` is an LRU with a byte budget in front of the disk store for a
process's lifetime (a server's): the same interface, hits in memory cost no read and no digest.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import stat
import struct
import time
from collections import OrderedDict
from pathlib import Path
from typing import Iterator, Sequence

from localspec.defaults import PROMPT_CACHE_BYTES
from localspec.printable import printable
from localspec.store.cachefile import cache_dir, file_lock, lstat_at, open_folder, read_regular, write_at

BLOCK = 64  # tokens per hashed block: a state is stored at a multiple of it
MIN_TOKENS = 2 * BLOCK  # shorter prefixes are decoded, not stored
DEFAULT_BUDGET = PROMPT_CACHE_BYTES  # bytes on disk (the setting prompt_cache_bytes)
DEFAULT_MEMORY_BUDGET = 1 << 30  # bytes in memory (MemoryStates)
FORMAT = 1
MAGIC = b"LSPSTATE"
FOLDER = "prompt-states"
LOCK = "prompt-states"
HEAD_BYTES = 1 << 16  # the most a JSON header takes
TEMP_AGE_S = 3600  # a temporary file older than this was left by a killed process: eviction removes it
# localspec's own names: <key digest 16>-<chain hash 32>.state, and the temporary files write_at renames into place
OWN_NAME = re.compile(r"[0-9a-f]{16}-[0-9a-f]{32}\.state")
OWN_TEMP = re.compile(r"\.([0-9a-f]{16}-[0-9a-f]{32}\.state)\.[0-9a-f]{12}\.tmp")
_PREFIX = struct.Struct("<8sII")  # magic, version, header length
TOKEN_LIMIT = 2**31


def folder() -> Path:
    return cache_dir() / FOLDER


def aligned(n: int) -> int:
    """The longest block-aligned prefix of n tokens that is stored (0: too short to store)."""
    n = int(n) // BLOCK * BLOCK
    return n if n >= MIN_TOKENS else 0


# ------------------------------------------------------------------ keys
_HEAD_TAIL: dict[tuple, str] = {}


def _file_identity(path) -> str:
    """A model file as it is now: resolved path, size, modification time and a digest of its first and last MiB
    (remembered per process while the file is unchanged: a write moves its ctime)."""
    p = Path(path).resolve()
    st = p.stat()
    memo = (str(p), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)  # ctime: bytes rewritten in place
    digest = _HEAD_TAIL.get(memo)
    if digest is None:
        h = hashlib.sha256()
        with open(p, "rb") as fh:
            h.update(fh.read(1 << 20))
            if st.st_size > 2 << 20:
                fh.seek(st.st_size - (1 << 20))
            h.update(fh.read(1 << 20))
        digest = _HEAD_TAIL[memo] = h.hexdigest()[:16]
    return f"{p}|{st.st_size}|{st.st_mtime_ns}|{digest}"


def state_key(model) -> str:
    """The key of a loaded Model's states: what changes their bytes (see the module's docstring)."""
    from localspec.knobs import knobs
    from localspec.llama.sysinfo import build_id

    parts = ["prompt-state", FORMAT, _file_identity(model.path), build_id(), model.kv_type, model.n_gpu_layers,
             model.n_threads, "no-repack" if knobs().no_repack else "", f"n_batch={model.n_batch}"]
    if getattr(model, "rpc_servers", None):
        parts += ["rpc=" + ",".join(model.rpc_servers), "split=" + str(getattr(model, "tensor_split", None))]
    return "|".join(str(x) for x in parts)


def _key_digest(key: str) -> str:
    return hashlib.sha256(b"localspec prompt state key\0" + key.encode("utf-8")).hexdigest()


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def _chain(kd: str, tokens: Sequence[int]) -> list[str]:
    """h_1..h_m (hex) of the whole blocks of `tokens` under the key digest `kd`."""
    h = hashlib.sha256(b"localspec prompt state chain\0" + kd.encode()).digest()
    out = []
    for i in range(len(tokens) // BLOCK):
        h = hashlib.sha256(h + _token_bytes(tokens[i * BLOCK:(i + 1) * BLOCK])).digest()
        out.append(h.hex())
    return out


def _name(kd: str, chain_hex: str) -> str:
    return f"{kd[:16]}-{chain_hex[:32]}.state"


def _valid_tokens(tokens: Sequence[int]) -> bool:
    return all(isinstance(t, int) and 0 <= t < TOKEN_LIMIT for t in tokens)


def encode(key: str, tokens: Sequence[int], data: bytes, label: str = "") -> bytes:
    """A state file's bytes (the module's docstring has the format)."""
    kd = _key_digest(key)
    tb = _token_bytes(tokens)
    digest = hashlib.sha256(kd.encode() + tb + data).hexdigest()
    head = json.dumps({"key": kd, "n_tokens": len(tokens), "payload_bytes": len(data), "sha256": digest,
                       "model": str(label)[:200], "created": int(time.time())}).encode()
    return _PREFIX.pack(MAGIC, FORMAT, len(head)) + head + tb + data


def _header(blob: bytes) -> tuple[dict, int] | None:
    """(header, offset of the tokens) of a state file's first bytes, or None where they are not one."""
    if len(blob) < _PREFIX.size:
        return None
    magic, version, n = _PREFIX.unpack_from(blob)
    if magic != MAGIC or version != FORMAT or n > HEAD_BYTES or len(blob) < _PREFIX.size + n:
        return None
    try:
        head = json.loads(blob[_PREFIX.size:_PREFIX.size + n])
    except (ValueError, RecursionError):
        return None
    if not (isinstance(head, dict) and isinstance(head.get("key"), str) and isinstance(head.get("n_tokens"), int)
            and isinstance(head.get("payload_bytes"), int) and isinstance(head.get("sha256"), str)):
        return None
    return head, _PREFIX.size + n


def decode_file(blob: bytes, key: str, tokens: Sequence[int]) -> bytes | None:
    """The payload of a state file's bytes where it is a whole, undamaged state of `key` for exactly `tokens`;
    None otherwise."""
    parsed = _header(blob)
    if parsed is None:
        return None
    head, off = parsed
    kd = _key_digest(key)
    n = len(tokens)
    if head["key"] != kd or head["n_tokens"] != n or len(blob) != off + 4 * n + head["payload_bytes"]:
        return None
    tb = blob[off:off + 4 * n]
    if tb != _token_bytes(tokens):
        return None
    payload = blob[off + 4 * n:]
    if hashlib.sha256(kd.encode() + tb + payload).hexdigest() != head["sha256"]:
        return None
    return payload


# ------------------------------------------------------------------ disk
class PromptStates:
    """The disk store (see the module's docstring). Never raises for what it finds in its folder; an unwritable
    cache dir only means nothing is stored."""

    def __init__(self, budget: int = DEFAULT_BUDGET, root: Path | None = None) -> None:
        self.budget = int(budget)
        self._root = Path(root) if root is not None else None
        self.notes: list[str] = []  # why a file was skipped or a store refused (for a report)

    @property
    def folder(self) -> Path:
        return self._root if self._root is not None else folder()

    def _note(self, text: str) -> None:
        self.notes.append(printable(text))
        del self.notes[:-20]

    @contextlib.contextmanager
    def _open(self, create: bool = False) -> Iterator[int | None]:
        if create:
            self.folder.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.folder, 0o700)
        with open_folder(self.folder) as dfd:
            yield dfd

    def _at(self, dfd: int | None, name: str):
        return name if dfd is not None else str(self.folder / name)

    # ---------------------------------------------------------- lookups
    def longest(self, key: str, tokens: Sequence[int], longer_than: int = 0) -> tuple[int, bytes] | None:
        """(n, state) of the longest stored prefix tokens[:n] of `tokens` under `key`, n > longer_than (None where
        there is none). A hit is marked recently used."""
        tokens = list(tokens)
        kd = _key_digest(key)
        chain = _chain(kd, tokens)
        try:
            with self._open() as dfd:
                for i in range(len(chain), 0, -1):
                    n = i * BLOCK
                    if n < MIN_TOKENS or n <= longer_than:
                        break
                    data = self._read(dfd, _name(kd, chain[i - 1]), key, tokens[:n])
                    if data is not None:
                        return n, data
        except OSError as exc:  # the folder is absent, a link or unreadable: no states
            if not isinstance(exc, FileNotFoundError):
                self._note(f"{self.folder}: {exc.strerror or exc}; prompt states not read")
        return None

    def has(self, key: str, tokens: Sequence[int]) -> bool:
        """Whether a state of exactly `tokens` under `key` is at its name (a regular file; not read, so not verified:
        a damaged one is removed by the next read, and stored again after that)."""
        tokens = list(tokens)
        if not tokens or aligned(len(tokens)) != len(tokens):
            return False
        kd = _key_digest(key)
        try:
            with self._open() as dfd:
                return stat.S_ISREG(lstat_at(self.folder, dfd, _name(kd, _chain(kd, tokens)[-1])).st_mode)
        except OSError:
            return False

    def _read(self, dfd: int | None, name: str, key: str, tokens: list[int]) -> bytes | None:
        try:
            st = lstat_at(self.folder, dfd, name)
        except FileNotFoundError:
            return None
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            self._note(f"{self.folder / name}: not a regular file; not read")
            return None
        try:
            blob, st = read_regular(self.folder, dfd, name, self.budget + HEAD_BYTES + 4 * len(tokens) + 64)
        except FileNotFoundError:  # evicted meanwhile
            return None
        except OSError as exc:
            self._note(f"{self.folder / name}: {exc.strerror or exc}; not read")
            return None
        data = decode_file(blob, key, tokens)
        if data is None:
            self._note(f"{self.folder / name}: damaged or not this model's state; removed")
            self._remove_if_same(dfd, name, st)
            return None
        with contextlib.suppress(OSError, NotImplementedError):  # recently used: eviction keeps it longer
            os.utime(self._at(dfd, name), dir_fd=dfd, follow_symlinks=os.utime not in os.supports_follow_symlinks)
        return data

    def _remove_if_same(self, dfd: int | None, name: str, st: os.stat_result) -> None:
        """Remove a damaged state file: only the regular file that was read (not one a store renamed there since)."""
        with contextlib.suppress(OSError):
            now = lstat_at(self.folder, dfd, name)
            if stat.S_ISREG(now.st_mode) and (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                os.unlink(self._at(dfd, name), dir_fd=dfd)

    # ---------------------------------------------------------- stores
    def put(self, key: str, tokens: Sequence[int], data: bytes, label: str = "") -> bool:
        """Store `data`, the state of exactly `tokens`, under `key`. Only a block-aligned prefix of MIN_TOKENS or
        more is stored (len(tokens) == aligned(len(tokens))); a state over the budget, a link or other non-file at
        its name, or an unwritable folder store nothing. Returns whether the state is on disk now."""
        tokens = list(tokens)
        n = len(tokens)
        if not data or n == 0 or aligned(n) != n or not _valid_tokens(tokens):
            return False
        kd = _key_digest(key)
        name = _name(kd, _chain(kd, tokens)[-1])
        size = _PREFIX.size + 4 * n + len(data)  # + the header: checked after encoding
        if size > self.budget:
            return False
        try:
            with self._open(create=True) as dfd:
                try:
                    st = lstat_at(self.folder, dfd, name)
                except FileNotFoundError:
                    st = None
                if st is not None and stat.S_ISREG(st.st_mode) and self._read(dfd, name, key, tokens) is not None:
                    return True  # a state of these tokens is stored already (and now marked recently used)
                blob = encode(key, tokens, data, label)
                if len(blob) > self.budget:
                    return False
                write_at(self.folder, dfd, name, blob)
                self._evict(dfd, keep=name)
                return True
        except OSError as exc:
            self._note(f"{self.folder / name}: {exc.strerror or exc}; prompt state not stored")
            return False

    def _entries(self, dfd: int | None) -> list[tuple[str, os.stat_result, bool]]:
        """(name, lstat, is a state) of localspec's own names in the folder (states and temporary files)."""
        out = []
        with os.scandir(dfd if dfd is not None else self.folder) as it:
            names = [e.name for e in it]
        for name in names:
            own, temp = OWN_NAME.fullmatch(name), OWN_TEMP.fullmatch(name)
            if not (own or temp):
                continue
            try:
                out.append((name, lstat_at(self.folder, dfd, name), bool(own)))
            except OSError:
                continue
        return out

    def _evict(self, dfd: int | None, keep: str = "") -> None:
        """Delete the least recently used states until the rest fit the budget, and old temporary files; under
        the store's lock, so two processes never pick the same file or leave the store over its budget."""
        with file_lock(LOCK):
            now = time.time()
            states = []
            for name, st, is_state in self._entries(dfd):
                if not stat.S_ISREG(st.st_mode):
                    continue
                if not is_state:
                    if now - st.st_mtime > TEMP_AGE_S:
                        with contextlib.suppress(OSError):
                            os.unlink(self._at(dfd, name), dir_fd=dfd)
                    continue
                states.append((st.st_mtime_ns, name, st.st_size))
            total = sum(s for _, _, s in states)
            for _, name, size in sorted(states):
                if total <= self.budget:
                    break
                if name == keep:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._at(dfd, name), dir_fd=dfd)
                total -= size

    # ---------------------------------------------------------- cache show / clear
    def summary(self) -> dict:
        """For `cache show`: {"folder", "count", "bytes", "budget", "models": {model file name: count}}. A file whose
        header does not read counts as "(damaged)"."""
        out = {"folder": str(self.folder), "count": 0, "bytes": 0, "budget": self.budget, "models": {}}
        try:
            with self._open() as dfd:
                for name, st, is_state in self._entries(dfd):
                    if not is_state or not stat.S_ISREG(st.st_mode):
                        continue
                    head = self._head(dfd, name)
                    label = printable(head[0].get("model") or head[0]["key"][:16]) if head else "(damaged)"
                    out["count"] += 1
                    out["bytes"] += st.st_size
                    out["models"][label] = out["models"].get(label, 0) + 1
        except OSError:
            pass
        return out

    def _head(self, dfd: int | None, name: str) -> tuple[dict, int] | None:
        """The header of a state file, reading only its first bytes (a regular file, opened as read_regular does)."""
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self._at(dfd, name), flags | getattr(os, "O_BINARY", 0), dir_fd=dfd)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            return _header(os.read(fd, _PREFIX.size + HEAD_BYTES))
        except OSError:
            return None
        finally:
            os.close(fd)

    def clear(self) -> int:
        """Delete every state and temporary file of localspec's names in the folder (a link there: the link, never
        what it points to; never a folder); returns how many were deleted."""
        n = 0
        try:
            with self._open() as dfd, file_lock(LOCK):
                for name, st, _ in self._entries(dfd):
                    if stat.S_ISDIR(st.st_mode):
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._at(dfd, name), dir_fd=dfd)
                        n += 1
        except OSError as exc:
            if not isinstance(exc, FileNotFoundError) and exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
        return n


# ------------------------------------------------------------------ memory
class MemoryStates:
    """An LRU of states within `budget` bytes, in front of a disk store (`below`, or none): the same interface.
    put keeps the state here and passes it down; longest answers from memory, and from the disk where it holds a
    longer prefix (which is then kept here too)."""

    def __init__(self, budget: int = DEFAULT_MEMORY_BUDGET, below: PromptStates | None = None) -> None:
        self.budget = int(budget)
        self.below = below
        self._items: OrderedDict[str, tuple[tuple[int, ...], bytes, str]] = OrderedDict()
        self.bytes = 0

    def _keep(self, name: str, tokens: tuple[int, ...], data: bytes, label: str) -> None:
        if len(data) > self.budget:
            return
        old = self._items.pop(name, None)
        if old is not None:
            self.bytes -= len(old[1])
        self._items[name] = (tokens, data, label)
        self.bytes += len(data)
        while self.bytes > self.budget:
            _, (_, dropped, _) = self._items.popitem(last=False)
            self.bytes -= len(dropped)

    def put(self, key: str, tokens: Sequence[int], data: bytes, label: str = "") -> bool:
        tokens = tuple(tokens)
        n = len(tokens)
        if not data or n == 0 or aligned(n) != n or not _valid_tokens(tokens):
            return False
        kd = _key_digest(key)
        self._keep(_name(kd, _chain(kd, tokens)[-1]) + kd, tokens, bytes(data), label)
        below = self.below.put(key, tokens, data, label) if self.below is not None else False
        return below or len(data) <= self.budget

    def longest(self, key: str, tokens: Sequence[int], longer_than: int = 0) -> tuple[int, bytes] | None:
        tokens = list(tokens)
        kd = _key_digest(key)
        chain = _chain(kd, tokens)
        hit = None
        for i in range(len(chain), 0, -1):
            n = i * BLOCK
            if n < MIN_TOKENS or n <= longer_than:
                break
            name = _name(kd, chain[i - 1]) + kd
            item = self._items.get(name)
            if item is not None and list(item[0]) == tokens[:n]:
                self._items.move_to_end(name)
                hit = (n, item[1])
                break
        if self.below is not None:
            deeper = self.below.longest(key, tokens, max(longer_than, hit[0] if hit else 0))
            if deeper is not None:
                self._keep(_name(kd, chain[deeper[0] // BLOCK - 1]) + kd, tuple(tokens[:deeper[0]]), deeper[1], "")
                return deeper
        return hit

    def summary(self) -> dict:
        out = self.below.summary() if self.below is not None else {}
        out["memory"] = {"count": len(self._items), "bytes": self.bytes, "budget": self.budget}
        return out

    def clear(self) -> int:
        n = len(self._items)
        self._items.clear()
        self.bytes = 0
        return n + (self.below.clear() if self.below is not None else 0)
