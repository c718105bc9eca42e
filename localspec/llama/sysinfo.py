"""Facts about this machine and build: threads, llama.cpp's version and system info, GPU offload."""

from __future__ import annotations

import os

from localspec.errors import UsageError
from localspec.llama import ggml, lib

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
        raise UsageError(f"threads must be between 1 and {hi}, got {n_threads}")


def default_threads() -> int:
    """All cores (llama-cpp-python's default of cpu_count//2 halves speed on small machines)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS
        return max(1, os.cpu_count() or 1)


def llama_cpp_version() -> str:
    ll = lib.require()
    return getattr(ll, "__version__", "unknown")


def system_info() -> str:
    ll = lib.require()
    ggml.ready()
    return ll.llama_print_system_info().decode("utf-8", "replace")


def supports_gpu_offload() -> bool:
    """True when llama.cpp has a GPU (or integrated GPU) device to offload layers to. (llama_supports_gpu_offload
    also answers True for any build with the RPC backend, which every localspec build has, GPU or not.)"""
    return any(d["type"] in ("gpu", "igpu") for d in ggml.devices())


def resolve_gpu_layers(n: int | None) -> int:
    """A layer count to offload: as given, or by default all layers (-1) when there is a GPU device, else 0."""
    if n is not None:
        return int(n)
    return -1 if supports_gpu_offload() else 0
