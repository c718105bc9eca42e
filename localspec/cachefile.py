"""Small JSON memos in localspec's cache dir (checksums verified, exact-batch probes)."""

from __future__ import annotations

import json
import os
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
    """Best effort: a read-only cache dir only costs a recomputation next time."""
    path = cache_dir() / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))
    except OSError:
        pass
