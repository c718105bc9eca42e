"""Small JSON memos in localspec's cache dir (checksums verified, exact-batch probes)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    return Path(os.environ.get("LOCALSPEC_CACHE_DIR") or platformdirs.user_cache_dir("localspec"))


def read_json(name: str) -> dict:
    try:
        return json.loads((cache_dir() / name).read_text())
    except (OSError, ValueError):
        return {}


def write_json(name: str, data: dict) -> None:
    """Atomic (a temp file, then os.replace: a reader never sees half a file, and two writers never interleave).
    Best effort: a read-only cache dir only costs a recomputation next time."""
    path = cache_dir() / name
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(data))
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
