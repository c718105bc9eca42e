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


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them in /proc/cpuinfo (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def hardware() -> dict:
    """What this build and machine offer, for `doctor`: llama-cpp-python's version and system info, GPU offload,
    RPC, devices, the CPU features that matter to llama.cpp, compiled backends, default threads, and `notes`
    (hints about the build for this hardware). A llama.cpp that does not load is reported, not raised."""
    out: dict = {}
    backends: list[str] = []
    try:
        out["llama_cpp_python"] = llama_cpp_version()
        out["system_info"] = system_info().strip()
        out["gpu_offload"] = supports_gpu_offload()
        out["rpc"] = ggml.rpc_available()  # `localspec worker` and --rpc
        backends = ggml.compiled_backends()
        out["devices"] = ggml.devices()
    except Exception as exc:
        out["llama_cpp_python"] = f"not working: {exc}"
        out["devices"] = []
    flags = cpu_flags()
    out["cpu_features"] = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "bmi2")))
    out["backends"] = backends
    out["threads"] = default_threads()
    notes = []
    if any(f.startswith("amx") for f in flags):
        notes.append("CPU has AMX: a default (-march=native) llama-cpp-python build can crash with SIGILL; "
                     "rebuild with the CMAKE_ARGS in the README, or set LOCALSPEC_NO_REPACK=1")
    if not any(d["type"] in ("gpu", "igpu") for d in out["devices"]):
        notes.append("CPU only. For an NVIDIA GPU (nvcc on PATH) or Apple Silicon, `bash .ci/install-llama-cpp` "
                     "builds llama.cpp with CUDA or Metal; layers then go to the GPU by default")
    out["notes"] = notes
    return out
