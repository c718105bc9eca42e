"""The scalar and string metadata of a local GGUF file, read without loading it: what the engine checks before a
load (the architecture of a draft file, a target's MTP layers).

The file is mapped, not read: only the metadata's pages are touched. Arrays (the tokenizer's 150k strings and merges)
are stepped over by their lengths, never decoded, so a 1.5B model's header is read in a fraction of a second (gguf's
GGUFReader builds every field of every array as numpy views: seconds on every `run`). Values are memoized per file
as it is now (path, size, modification time)."""

from __future__ import annotations

import mmap
import os
import struct

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MEMO: dict[tuple, dict] = {}


class _Bad(Exception):
    pass


def _skip(buf, off: int, typ: int, depth: int = 0) -> int:
    """The offset after a value of type `typ` at `off`."""
    if typ in _SCALARS:
        return off + struct.calcsize(_SCALARS[typ])
    if typ == _STRING:
        (n,) = struct.unpack_from("<Q", buf, off)
        return off + 8 + n
    if typ == _ARRAY and depth < 4:
        sub, n = struct.unpack_from("<IQ", buf, off)
        off += 12
        if sub in _SCALARS:
            return off + struct.calcsize(_SCALARS[sub]) * n
        if sub == _STRING:
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(n):
                off += 8 + unpack(buf, off)[0]
            return off
        for _ in range(n):
            off = _skip(buf, off, sub, depth + 1)
        return off
    raise _Bad(f"unknown GGUF value type {typ}")


def _scan(buf) -> dict:
    if bytes(buf[:4]) != b"GGUF":
        raise _Bad("not a GGUF file")
    version, _, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise _Bad("GGUF version too old")
    off, out = 24, {}
    for _ in range(n_kv):
        (klen,) = struct.unpack_from("<Q", buf, off)
        key = bytes(buf[off + 8 : off + 8 + klen]).decode("utf-8", "replace")
        off += 8 + klen
        (typ,) = struct.unpack_from("<I", buf, off)
        off += 4
        if typ in _SCALARS:
            out[key] = struct.unpack_from(_SCALARS[typ], buf, off)[0]
        elif typ == _STRING:
            (n,) = struct.unpack_from("<Q", buf, off)
            out[key] = bytes(buf[off + 8 : off + 8 + n]).decode("utf-8", "replace")
        off = _skip(buf, off, typ)
    return out


def metadata(path: str | os.PathLike) -> dict:
    """Key -> value of a GGUF file's scalar and string metadata (arrays left out); {} where it cannot be read."""
    try:
        st = os.stat(path)
        memo = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
        if memo in _MEMO:
            return _MEMO[memo]
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            out = _scan(mm)
    except (OSError, ValueError, struct.error, _Bad):
        return {}
    _MEMO[memo] = out
    return out
