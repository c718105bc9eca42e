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


def build_id() -> str:
    """The llama.cpp build and the CPU it runs on: its version, what it was compiled with (llama_print_system_info's
    features and backends) and the CPU's features. A rebuild with other CMAKE_ARGS (AVX-512 off, CUDA on) keeps the
    version, and a cache dir shared between machines (a network home) keeps the file, but either changes the
    kernels, and so what the probes measure and the bytes of a prompt state. (Not the devices' list: asking an RPC
    device is a network call.) Read once per process: the build does not change under it."""
    if not _BUILD_ID:
        import hashlib

        what = [system_info(), *sorted(cpu_flags())]
        _BUILD_ID.append(f"{llama_cpp_version()}+{hashlib.sha256(chr(10).join(what).encode()).hexdigest()[:12]}")
    return _BUILD_ID[0]


_BUILD_ID: list[str] = []


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
