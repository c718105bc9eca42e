"""Facts about this machine and build: threads, llama.cpp's version and system info, GPU offload."""

from __future__ import annotations

from localspec.llama import ggml, lib
from localspec.llama.threads import MAX_THREADS_CAP, check_threads, default_threads, max_threads  # noqa: F401


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
