"""How many CPU threads a model may use. Only the CPU count: checking a setting never loads llama.cpp."""

from __future__ import annotations

import os

from localspec.errors import SettingError

MAX_THREADS_CAP = 512


def max_threads() -> int:
    """The most threads a model may use: 4 per core, at most 512 (llama.cpp hangs or crashes far above)."""
    return min(MAX_THREADS_CAP, 4 * max(default_threads(), os.cpu_count() or 1))


def check_threads(n_threads: int | None) -> None:
    """Raise UsageError unless n_threads is None (all cores) or 1..max_threads()."""
    if n_threads is None:
        return
    hi = max_threads()
    if isinstance(n_threads, bool) or not isinstance(n_threads, int) or not 1 <= n_threads <= hi:
        raise SettingError(f"{{threads}} must be between 1 and {hi}, got {n_threads}", "threads")


def default_threads() -> int:
    """All cores (llama-cpp-python's default of cpu_count//2 halves speed on small machines)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS
        return max(1, os.cpu_count() or 1)
