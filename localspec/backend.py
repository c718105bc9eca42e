"""The one module that imports llama_cpp. Everything above talks to `Model`.

Low-level API only: a batch decode returns logits for the rows asked for (never logits_all),
KV entries are removed with llama_memory_seq_rm, flash attention is forced on (with it off a row's
logits depend on the batch size, which breaks exactness between plain and speculative decoding).
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from . import rpc
from .compat import VocabInfo
from .errors import DecodeError, ModelLoadError, UsageError
from .seq import common_prefix

_DEBUG = os.environ.get("LOCALSPEC_DEBUG", "") not in ("", "0")
if not _DEBUG:
    # ggml forks gdb for a backtrace on GGML_ABORT and on uncaught C++ exceptions (the latter decided when the
    # library loads, so this must come before the import); users get one `error:` line instead (see on_abort)
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")

try:  # imported lazily-safe: a broken install becomes a clear error at load time
    import llama_cpp as _ll
except Exception as exc:  # pragma: no cover - exercised only on broken installs
    _ll = None
    _IMPORT_ERROR = exc
else:
    _IMPORT_ERROR = None

_backend_lock = threading.Lock()
_backend_ready = False
_log_cb = None


def _require():
    if _ll is None:
        raise ModelLoadError(f"llama-cpp-python is not importable: {_IMPORT_ERROR}")
    return _ll


def _c_noop_log_callback(ll):
    """llama.cpp's log callback as a C function that ignores its arguments, or None where none is found.

    A Python callback would run Python inside llama.cpp: Ctrl-C arriving then raises KeyboardInterrupt inside the
    ctypes callback, which ctypes prints ("Exception ignored on calling ctypes callback") and drops, so the
    interrupt is lost. libc's `abs(int)` reads only the first argument (the level), has no side effect, and its
    result is discarded by the caller, so it serves as a no-op with the callback's register calling convention.
    """
    try:
        libc = ctypes.CDLL(None) if os.name != "nt" else ctypes.cdll.msvcrt
        addr = ctypes.cast(libc.abs, ctypes.c_void_p).value
    except (OSError, AttributeError):  # pragma: no cover - exotic platforms
        return None
    return ll.llama_log_callback(addr) if addr else None


def _init_backend() -> None:
    global _backend_ready, _log_cb
    ll = _require()
    with _backend_lock:
        if _backend_ready:
            return
        if not os.environ.get("LOCALSPEC_LLAMA_LOG"):
            # silence llama.cpp's chatter on stderr (stderr belongs to our status line)
            _log_cb = _c_noop_log_callback(ll)
            if _log_cb is None:  # pragma: no cover - no libc: a Python no-op (Ctrl-C may then be lost while loading)
                @ll.llama_log_callback
                def _quiet(level, text, user_data):  # noqa: ARG001
                    return None

                _log_cb = _quiet
            ll.llama_log_set(_log_cb, ctypes.c_void_p(0))
        ll.llama_backend_init()
        if not _DEBUG:
            _install_abort_handler()
        _backend_ready = True


class _DeferSignals:
    """While llama.cpp loads a model (main thread only): SIGINT/SIGTERM/SIGHUP only set a flag, so no Python
    exception is raised inside a ctypes callback (where it would be dropped); the load's progress callback sees the
    flag and aborts loading; on exit the first signal is delivered to the handler that was installed before."""

    SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))

    def __init__(self) -> None:
        self.received: int | None = None
        self._saved: dict[int, object] = {}

    def _flag(self, signum, frame) -> None:  # noqa: ARG002
        if self.received is None:
            self.received = signum

    def progress(self, fraction, user_data) -> bool:  # noqa: ARG002 - llama_progress_callback: False aborts
        return self.received is None

    def __enter__(self) -> "_DeferSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                h = signal.getsignal(s)
                if callable(h):  # a Python handler (default_int_handler for SIGINT): defer it
                    self._saved[s] = signal.signal(s, self._flag)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._saved.items():
            signal.signal(s, h)
        if self.received is not None and exc[0] is None:
            self._saved[self.received](self.received, None)


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
    ll = _require()
    return getattr(ll, "__version__", "unknown")


def system_info() -> str:
    ll = _require()
    _init_backend()
    return ll.llama_print_system_info().decode("utf-8", "replace")


def supports_gpu_offload() -> bool:
    """True when llama.cpp has a GPU (or integrated GPU) device to offload layers to. (llama_supports_gpu_offload
    also answers True for any build with the RPC backend, which every localspec build has, GPU or not.)"""
    return any(d["type"] in ("gpu", "igpu") for d in devices())


# ggml's backend registry and devices. llama-cpp-python does not bind these; libllama's handle resolves them from
# the ggml libraries it links (prototypes from ggml-backend.h).
DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}
_ggml_ready = False


def _ggml_lib():
    global _ggml_ready
    ll = _require()
    _init_backend()
    lib = ll.llama_cpp._lib
    if not _ggml_ready:
        c = ctypes
        for name, res, args in (
            ("ggml_backend_reg_count", c.c_size_t, []),
            ("ggml_backend_reg_get", c.c_void_p, [c.c_size_t]),
            ("ggml_backend_reg_name", c.c_char_p, [c.c_void_p]),
            ("ggml_backend_dev_count", c.c_size_t, []),
            ("ggml_backend_dev_get", c.c_void_p, [c.c_size_t]),
            ("ggml_backend_dev_name", c.c_char_p, [c.c_void_p]),
            ("ggml_backend_dev_description", c.c_char_p, [c.c_void_p]),
            ("ggml_backend_dev_type", c.c_int, [c.c_void_p]),
            ("ggml_backend_dev_memory", None, [c.c_void_p, c.POINTER(c.c_size_t), c.POINTER(c.c_size_t)]),
            ("ggml_backend_dev_backend_reg", c.c_void_p, [c.c_void_p]),
        ):
            f = getattr(lib, name)
            f.restype, f.argtypes = res, args
        _ggml_ready = True
    return lib


def _text(b: bytes | None) -> str:
    return (b or b"").decode("utf-8", "replace")


def compiled_backends() -> list[str]:
    """The ggml backends this build registered (e.g. CPU, CUDA, Metal, RPC)."""
    lib = _ggml_lib()
    return [_text(lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i))) for i in range(lib.ggml_backend_reg_count())]


def devices() -> list[dict]:
    """Every device llama.cpp can run on: name, description, type (cpu | gpu | igpu | accel), backend, free and
    total memory in bytes."""
    lib = _ggml_lib()
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = int(lib.ggml_backend_dev_type(dev))
        out.append({
            "name": _text(lib.ggml_backend_dev_name(dev)),
            "description": _text(lib.ggml_backend_dev_description(dev)),
            "type": DEVICE_TYPES.get(kind, str(kind)),
            "backend": _text(lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev))),
            "memory_free": int(free.value),
            "memory_total": int(total.value),
        })
    return out


def resolve_gpu_layers(n: int | None) -> int:
    """A layer count to offload: as given, or by default all layers (-1) when there is a GPU device, else 0."""
    if n is not None:
        return int(n)
    return -1 if supports_gpu_offload() else 0


# ----------------------------------------------------------------- ggml: devices, RPC, aborts
# llama-cpp-python binds libllama only; the backend registry (libggml), the RPC backend (built into libggml with
# -DGGML_RPC=ON, reached through ggml_backend_reg_get_proc_address as llama.cpp's own tools do) and
# ggml_set_abort_callback (libggml-base) come from the shared libraries next to it in llama_cpp/lib/.
_ggml_libs: list | None = None
_fn_cache: dict = {}
_SIGS = {
    "ggml_backend_reg_by_name": (ctypes.c_void_p, [ctypes.c_char_p]),
    "ggml_backend_reg_get_proc_address": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]),
    "ggml_backend_reg_dev_count": (ctypes.c_size_t, [ctypes.c_void_p]),
    "ggml_backend_reg_dev_get": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t]),
    "ggml_backend_dev_count": (ctypes.c_size_t, []),
    "ggml_backend_dev_get": (ctypes.c_void_p, [ctypes.c_size_t]),
    "ggml_backend_dev_type": (ctypes.c_int, [ctypes.c_void_p]),
    "ggml_backend_dev_name": (ctypes.c_char_p, [ctypes.c_void_p]),
    "ggml_backend_dev_description": (ctypes.c_char_p, [ctypes.c_void_p]),
    "ggml_set_abort_callback": (ctypes.c_void_p, [ctypes.c_void_p]),
}
DEV_CPU, DEV_GPU, DEV_IGPU, DEV_ACCEL = 0, 1, 2, 3
_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
_START_SERVER = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                 ctypes.POINTER(ctypes.c_void_p))
_ABORT_CB_T = ctypes.CFUNCTYPE(None, ctypes.c_char_p)


def _ggml(name: str):
    """A ggml C function from llama_cpp/lib (libggml-base or libggml), typed from _SIGS; None if absent."""
    global _ggml_libs
    if name in _fn_cache:
        return _fn_cache[name]
    _require()
    if _ggml_libs is None:
        _ggml_libs = []
        for path in _loaded_ggml_paths():
            try:
                _ggml_libs.append(ctypes.CDLL(path))
            except OSError:
                pass
    fn = None
    for lib in _ggml_libs:
        f = getattr(lib, name, None)
        if f is not None:
            fn = f
            fn.restype, fn.argtypes = _SIGS[name]
            break
    _fn_cache[name] = fn
    return fn


def _loaded_ggml_paths() -> list[str]:
    """The files of libggml-base and libggml that libllama itself loaded. A wheel cannot hold symlinks, so
    llama_cpp/lib has libggml-base.so, .so.0 and .so.0.25.3 as three copies: opening another name than the one
    libllama's DT_NEEDED resolved to would load a second ggml, with its own abort callback and backend registry."""
    names = ("ggml-base", "ggml")
    found: dict[str, str] = {}
    images: list[str] = []
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/self/maps") as fh:
                images = [line.split(None, 5)[5].strip() for line in fh if len(line.split(None, 5)) == 6]
        except OSError:
            images = []
    elif sys.platform == "darwin":
        try:
            dyld = ctypes.CDLL(None)
            dyld._dyld_get_image_name.restype = ctypes.c_char_p
            images = [dyld._dyld_get_image_name(i).decode() for i in range(dyld._dyld_image_count())]
        except (OSError, AttributeError):
            images = []
    for img in images:
        base = os.path.basename(img)
        stem = base[3:] if base.startswith("lib") else base
        stem = stem.split(".", 1)[0]
        # prefer the soname (libggml.so.0): a bare libggml.so may be a copy that llama_cpp._ggml loaded
        if stem in names and (stem not in found or re.search(r"\.so\.\d+$", img)):
            found[stem] = img
    if sys.platform == "win32":  # LoadLibrary of a loaded module's base name returns that module
        found = {n: f"{n}.dll" for n in names}
    return [found[n] for n in names if n in found]


def _rpc_proc(name: str):
    """ggml_backend_rpc_add_server / _start_server through the RPC registry, or None without RPC."""
    _init_backend()
    by_name, proc = _ggml("ggml_backend_reg_by_name"), _ggml("ggml_backend_reg_get_proc_address")
    if by_name is None or proc is None:
        return None
    reg = by_name(b"RPC")
    return proc(reg, name.encode()) if reg else None


def rpc_available() -> bool:
    """This llama.cpp build has the RPC backend (-DGGML_RPC=ON)."""
    try:
        return bool(_rpc_proc("ggml_backend_rpc_add_server"))
    except Exception:
        return False


def _need_rpc(name: str):
    addr = _rpc_proc(name)
    if not addr:
        raise rpc.RPCError("this llama-cpp-python build has no RPC backend; reinstall it with -DGGML_RPC=ON "
                           "(bash .ci/install-llama-cpp does)")
    return addr


def _local_devices(types: set[int]) -> list[int]:
    count, get, typ = _ggml("ggml_backend_dev_count"), _ggml("ggml_backend_dev_get"), _ggml("ggml_backend_dev_type")
    return [d for d in (get(i) for i in range(count())) if typ(d) in types]


def rpc_start_server(endpoint: str, cache_dir: str | None, n_threads: int) -> None:
    """llama.cpp's RPC server on endpoint (IPv4 HOST:PORT), serving this machine's GPUs, else its CPU.
    Blocks for as long as it serves (the GIL is released); returns only when it cannot listen."""
    start = _START_SERVER(_need_rpc("ggml_backend_rpc_start_server"))
    devices = _local_devices({DEV_GPU}) or _local_devices({DEV_CPU})  # as llama.cpp's rpc-server chooses
    if not devices:
        raise ModelLoadError("llama.cpp found no device to serve")
    arr = (ctypes.c_void_p * len(devices))(*devices)
    global _log_cb
    if not os.environ.get("LOCALSPEC_LLAMA_LOG"):
        ll = _ll

        @ll.llama_log_callback
        def _errors_only(level, text, user_data):  # noqa: ARG001 - a worker shows llama.cpp's errors
            if level == 4 and text:  # GGML_LOG_LEVEL_ERROR
                sys.stderr.write(text.decode("utf-8", "replace"))
                sys.stderr.flush()

        _log_cb = _errors_only
        ll.llama_log_set(_log_cb, ctypes.c_void_p(0))
    start(endpoint.encode(), cache_dir.encode() if cache_dir else None, int(n_threads), len(devices), arr)


def _rpc_devices(servers: Sequence[str]) -> list[int]:
    """Each worker's devices (llama.cpp connects here; `rpc.preflight` made sure it will not abort)."""
    add = _ADD_SERVER(_need_rpc("ggml_backend_rpc_add_server"))
    n_of, get = _ggml("ggml_backend_reg_dev_count"), _ggml("ggml_backend_reg_dev_get")
    devs: list[int] = []
    for ep in servers:
        reg = add(ep.encode())
        if not reg or n_of(reg) == 0:
            raise rpc.RPCError(f"RPC worker {ep} offers no device")
        devs += [get(reg, i) for i in range(n_of(reg))]
    return devs


# Hooks run when llama.cpp aborts the process (GGML_ABORT: a worker died mid-decode, a failed assertion). The
# process dies right after them: they must be quick and must not raise (exceptions are ignored).
_abort_hooks: list[Callable[[], None]] = []
_rpc_in_use: list[str] = []  # endpoints of loaded models, for naming the worker that died
_abort_cb = None


def on_abort(callback: Callable[[], None]) -> Callable[[], None]:
    """Run `callback` before the process dies of a llama.cpp abort (e.g. save the chat transcript).
    Returns it, so it works as a decorator; remove it with `remove_abort_hook`. Adding one twice runs it once."""
    if callback not in _abort_hooks:
        _abort_hooks.append(callback)
    return callback


def remove_abort_hook(callback: Callable[[], None]) -> None:
    if callback in _abort_hooks:
        _abort_hooks.remove(callback)


def abort_message(message: str, endpoints: Sequence[str]) -> str:
    """The one line a user sees for llama.cpp's abort `message`."""
    msg = " ".join(message.split())
    m = re.match(r"^\S+?:\d+: (.*)$", msg)  # ggml_abort prefixes "FILE:LINE: "
    core = m.group(1) if m else msg
    if endpoints and ("RPC" in msg or "connect" in msg or "handshake" in msg):
        dead = rpc.refusing(endpoints)
        who = ", ".join(dead or endpoints)
        s = "" if len(dead or endpoints) == 1 else "s"
        return (f"error: RPC worker{s} {who} stopped responding; the answer so far is kept; start the worker again "
                f"(localspec worker) and rerun (llama.cpp: {core})")
    return f"error: llama.cpp aborted: {core}"


def _on_ggml_abort(message: bytes | None) -> None:
    """ggml_abort calls this (from whichever thread aborted) before abort(): flush, run the hooks, say one line,
    exit 1 (instead of a gdb backtrace, SIGABRT and a core dump)."""
    try:
        text = (message or b"").decode("utf-8", "replace")
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        for hook in list(_abort_hooks):
            try:
                hook()
            except BaseException:
                pass
        try:
            sys.stdout.flush()
        except Exception:
            pass
        line = abort_message(text, list(_rpc_in_use))
        lead = "\n" if sys.stdout.isatty() and sys.stderr.isatty() else ""
        os.write(2, (lead + line + "\n").encode("utf-8", "replace"))
    finally:
        os._exit(1)


def _install_abort_handler() -> None:
    global _abort_cb
    setter = _ggml("ggml_set_abort_callback")
    if setter is None or _abort_cb is not None:
        return
    _abort_cb = _ABORT_CB_T(_on_ggml_abort)
    setter(ctypes.cast(_abort_cb, ctypes.c_void_p))


_C_SPACE = " \t\n\v\f\r"  # isspace() in the C locale, as llama.cpp strips around tokens

GGML_TYPES = {"f16": 1, "q8_0": 8, "bf16": 30}

VOCAB_TYPES = {0: "none", 1: "spm", 2: "bpe", 3: "wpm", 4: "ugm", 5: "rwkv", 6: "plamo2"}


class Model:
    """A loaded GGUF model with one context (sequence 0) and a token-tracked KV cache."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        n_ctx: int = 4096,
        n_gpu_layers: int = 0,
        n_threads: int | None = None,
        n_batch: int = 512,
        rpc_servers: Sequence[str] | None = None,
        tensor_split: Sequence[float] | None = None,
    ) -> None:
        """rpc_servers: llama.cpp RPC workers ("HOST:PORT") that take this model's layers (all of them unless
        n_gpu_layers says how many; the rest stay on the local CPU), in tensor_split proportions (one per
        device: the workers' devices in order, then local GPUs; default: by free memory)."""
        check_threads(n_threads)  # before llama.cpp sees it: 100000 threads crash it, 1000 hang it
        ll = _require()
        _init_backend()
        self._model = self._ctx = self._batch = None
        self.path = Path(path)
        self.rpc_servers = list(rpc_servers or [])
        self._ctx = None
        self._batch = None
        self._model = None
        if not self.path.is_file():
            raise ModelLoadError(f"model file not found: {self.path}")
        with open(self.path, "rb") as fh:
            if fh.read(4) != b"GGUF":
                raise ModelLoadError(f"not a GGUF file (bad magic): {self.path}")
        mparams = ll.llama_model_default_params()
        keep = []  # ctypes arrays that must live until the load returns
        local_gpus: list[int] = []
        if self.rpc_servers:
            rpc.preflight(self.rpc_servers)  # llama.cpp aborts the process on a worker it cannot use
            local_gpus = _local_devices({DEV_GPU})
            devices = _rpc_devices(self.rpc_servers) + local_gpus  # llama.cpp's order: RPC first
            arr = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)  # NULL-terminated
            keep.append(arr)
            mparams.devices = ctypes.cast(arr, ctypes.c_void_p).value
            if n_gpu_layers == 0:
                n_gpu_layers = -1  # all layers on the devices: that is what the workers are for
            n_devices = len(devices)
        else:
            n_devices = int(ll.llama_max_devices())
        if tensor_split:
            if len(tensor_split) > n_devices:
                raise UsageError(f"--tensor-split has {len(tensor_split)} values but the target has {n_devices} "
                                 f"device{'s' if n_devices != 1 else ''} to split over")
            ts = (ctypes.c_float * int(ll.llama_max_devices()))(*[float(x) for x in tensor_split])
            keep.append(ts)
            mparams.tensor_split = ctypes.cast(ts, ctypes.POINTER(ctypes.c_float))
        self.tensor_split = list(tensor_split) if tensor_split else None
        mparams.n_gpu_layers = int(n_gpu_layers)
        self.n_gpu_layers = int(n_gpu_layers)
        if os.environ.get("LOCALSPEC_NO_REPACK"):
            # work-around for CPUs where the native build's AMX path crashes (see README)
            mparams.use_extra_bufts = False
        if self.rpc_servers:
            _rpc_in_use.extend(self.rpc_servers)
        deferred = _DeferSignals()  # Ctrl-C aborts the load (through the progress callback) and is re-raised
        progress = ll.llama_progress_callback(deferred.progress)
        mparams.progress_callback = progress
        try:
            with deferred:
                self._model = ll.llama_model_load_from_file(str(self.path).encode(), mparams)
        except BaseException:  # KeyboardInterrupt, re-raised when the load returned
            self.close()
            self._release_rpc()
            raise
        del keep
        if not self._model:
            self._release_rpc()
            if deferred.received is not None:  # the previous handler chose not to raise
                raise ModelLoadError(f"loading {self.path.name} was interrupted")
            raise ModelLoadError(f"llama.cpp could not load {self.path} (corrupt, truncated or unsupported GGUF)")
        try:
            self._vocab = ll.llama_model_get_vocab(self._model)
            self.n_vocab = int(ll.llama_vocab_n_tokens(self._vocab))
            n_train = int(ll.llama_model_n_ctx_train(self._model))
            self.n_ctx_train = n_train
            n_ctx = int(n_ctx) if n_ctx and n_ctx > 0 else n_train
            self.n_threads = int(n_threads or default_threads())
            self.n_batch = int(n_batch)
            cparams = ll.llama_context_default_params()
            cparams.n_ctx = n_ctx
            cparams.n_batch = self.n_batch
            cparams.n_ubatch = self.n_batch
            cparams.n_seq_max = 1
            cparams.n_threads = self.n_threads
            cparams.n_threads_batch = self.n_threads
            cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
            # BF16 KV on the CPU: llama.cpp's flash attention splits a single query's KV across threads once
            # the cache passes 512 cells (f16/f32 KV only), so a one-token decode and a batched verify would sum
            # in different orders (logits moved by ~0.5 on Qwen 1.5B). With BF16 KV both take the same path.
            # RPC workers without local GPUs: BF16 too (a worker's CPU backend computes as the local one does;
            # GPU workers whose flash attention lacks BF16 need LOCALSPEC_KV_TYPE=f16).
            on_cpu = self.n_gpu_layers == 0 or (self.rpc_servers and not local_gpus)
            kv = os.environ.get("LOCALSPEC_KV_TYPE") or ("bf16" if on_cpu else "f16")
            if kv not in GGML_TYPES:
                raise ModelLoadError(f"LOCALSPEC_KV_TYPE must be one of {', '.join(GGML_TYPES)}, got {kv!r}")
            self.kv_type = kv
            cparams.type_k = cparams.type_v = GGML_TYPES[kv]
            cparams.no_perf = True
            with _DeferSignals():
                self._ctx = ll.llama_init_from_model(self._model, cparams)
            if not self._ctx:
                raise ModelLoadError(f"could not create a context of {n_ctx} tokens for {self.path.name}")
            self.n_ctx = int(ll.llama_n_ctx(self._ctx))
            self.n_batch = int(ll.llama_n_batch(self._ctx))  # llama.cpp caps it at n_ctx
            self._mem = ll.llama_get_memory(self._ctx)
            self._batch = ll.llama_batch_init(self.n_batch, 0, 1)
        except BaseException:  # KeyboardInterrupt too: free what was allocated
            self.close()
            raise
        self.reused = 0  # prefix tokens the last sync() kept from the cache
        self.decode_s = 0.0  # time spent inside llama_decode (for overhead accounting in benchmarks)
        self.decode_calls = 0
        self.tokens: list[int] = []  # tokens whose KV is in the cache, position i = tokens[i]
        self._piece_cache: dict[int, bytes] = {}

    # ------------------------------------------------------------------ facts
    @property
    def name(self) -> str:
        return self.path.name

    def size_bytes(self) -> int:
        return int(_ll.llama_model_size(self._model))

    def memory_bytes(self) -> int:
        """Weights plus this context's state (KV cache and buffers)."""
        try:
            state = int(_ll.llama_state_get_size(self._ctx))
        except Exception:  # pragma: no cover
            state = 0
        return self.size_bytes() + state

    def chat_template(self) -> str | None:
        ptr = _ll.llama_model_chat_template(self._model, None)
        return ptr.decode("utf-8", "replace") if ptr else None

    def is_eog(self, token: int) -> bool:
        return bool(_ll.llama_vocab_is_eog(self._vocab, token))

    def vocab_info(self) -> VocabInfo:
        ll = _ll
        v = self._vocab
        return VocabInfo(
            vocab_type=VOCAB_TYPES.get(int(ll.llama_vocab_type(v)), "unknown"),
            n_vocab=self.n_vocab,
            bos=int(ll.llama_vocab_bos(v)),
            eos=int(ll.llama_vocab_eos(v)),
            add_bos=bool(ll.llama_vocab_get_add_bos(v)),
            add_eos=bool(ll.llama_vocab_get_add_eos(v)),
            token_text=_LazyTokenText(self),
        )

    def token_text(self, token: int) -> bytes:
        ptr = _ll.llama_vocab_get_text(self._vocab, token)
        return ptr or b""

    # ------------------------------------------------------------- text <-> ids
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 16
        buf = (_ll.llama_token * n_max)()
        n = _ll.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (_ll.llama_token * n_max)()
            n = _ll.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """Bytes of one token as it appears in generated text (special tokens not rendered)."""
        b = self._piece_cache.get(token)
        if b is None:
            buf = ctypes.create_string_buffer(64)
            n = _ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = _ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            b = buf.raw[:n]
            self._piece_cache[token] = b
        return b

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def special_text(self, which: str) -> str:
        """The text of the BOS or EOS token ("" if the model has none), as chat templates print it."""
        tok = {"bos": _ll.llama_vocab_bos, "eos": _ll.llama_vocab_eos}[which](self._vocab)
        return self.token_text(tok).decode("utf-8", "replace") if tok >= 0 else ""

    def tokenize_segments(self, segments: Sequence[tuple[str, bool]]) -> list[int]:
        """Tokenize a rendered chat prompt given as (text, is_content) pieces, with BOS as the vocab wants it.

        Control tokens are recognised only in the template's markup (is_content False); message content is always
        plain text, so '<|im_end|>' written by a user stays text. Otherwise the result equals llama.cpp's own
        tokenization of the joined text with parse_special: the markup is split at its control tokens (longest
        text first, with the tokens' lstrip/rstrip attributes) and each text run between control tokens, markup
        and content together, is tokenized whole, as llama.cpp tokenizes the fragments between special tokens.
        """
        items: list[str | int] = []  # text runs and control token ids
        rstrip_next = False

        def add_text(t: str) -> None:
            nonlocal rstrip_next
            if rstrip_next:
                t = t.lstrip(_C_SPACE)
                rstrip_next = not t
            if not t:
                return
            if items and isinstance(items[-1], str):
                items[-1] += t
            else:
                items.append(t)

        for text, is_content in segments:
            if is_content:
                add_text(text)
                continue
            for part in self._split_control(text):
                if isinstance(part, str):
                    add_text(part)
                    continue
                tok, attr = part
                if attr & _ll.LLAMA_TOKEN_ATTR_LSTRIP and items and isinstance(items[-1], str):
                    items[-1] = items[-1].rstrip(_C_SPACE)
                    if not items[-1]:
                        items.pop()
                items.append(tok)
                rstrip_next = bool(attr & _ll.LLAMA_TOKEN_ATTR_RSTRIP)
        out: list[int] = []
        v = self._vocab
        bos = int(_ll.llama_vocab_bos(v))
        if _ll.llama_vocab_get_add_bos(v) and bos >= 0 and not (items and items[0] == bos):
            out.append(bos)  # a template that prints bos_token itself gets it once, not twice
        for item in items:
            if isinstance(item, int):
                out.append(item)
            else:
                out += self.tokenize(item, add_special=False, parse_special=False)
        return out

    def _split_control(self, text: str) -> list:
        """`text` split into str runs and (token, attr) for every control/unknown token llama.cpp would match."""
        specials: dict[str, tuple[int, int]] = {}
        mask = _ll.LLAMA_TOKEN_ATTR_CONTROL | _ll.LLAMA_TOKEN_ATTR_UNKNOWN
        for t in set(self.tokenize(text, add_special=False, parse_special=True)):
            attr = int(_ll.llama_vocab_get_attr(self._vocab, t))
            if attr & mask and self.token_text(t):
                specials[self.token_text(t).decode("utf-8", "replace")] = (t, attr)
        parts: list = [text]
        for s in sorted(specials, key=len, reverse=True):
            split: list = []
            for p in parts:
                if not isinstance(p, str):
                    split.append(p)
                    continue
                for i, chunk in enumerate(p.split(s)):
                    if i:
                        split.append(specials[s])
                    if chunk:
                        split.append(chunk)
            parts = split
        return parts

    # -------------------------------------------------------------- the cache
    def truncate(self, n_keep: int) -> None:
        """Remove KV entries from position n_keep on (rollback of rejected tokens)."""
        if n_keep >= len(self.tokens):
            return
        ok = _ll.llama_memory_seq_rm(self._mem, 0, n_keep, -1)
        if not ok:
            raise DecodeError(
                f"{self.name}: llama.cpp cannot remove KV entries from position {n_keep} "
                "(recurrent/hybrid models cannot roll back; use --method none)"
            )
        del self.tokens[n_keep:]

    def clear(self) -> None:
        _ll.llama_memory_clear(self._mem, True)
        self.tokens.clear()

    def decode(self, tokens: Sequence[int], logit_rows: Sequence[int] | str = "last", copy: bool = True) -> np.ndarray:
        """Append `tokens` at the end of the cache; return logits for the rows asked for.

        logit_rows: "last", "all", or indices into `tokens`. Returns an array (rows, n_vocab). With
        copy=False (single-chunk decodes only) it is a view of llama.cpp's buffer, valid until the next decode:
        the hot path reads argmax from it without copying ~0.6 MB per row.
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("decode() needs at least one token")
        if logit_rows == "last":
            rows = [n - 1]
        elif logit_rows == "all":
            rows = list(range(n))
        else:
            rows = list(logit_rows)
        if len(self.tokens) + n > self.n_ctx:
            raise DecodeError(f"{self.name}: context full ({len(self.tokens)} + {n} > {self.n_ctx} tokens)")
        want = set(rows)
        out: list[np.ndarray] = []
        b = self._batch
        start = 0
        while start < n:
            chunk = tokens[start : start + self.n_batch]
            base = len(self.tokens)
            m = len(chunk)
            b.n_tokens = m
            chunk_rows = []
            for i, t in enumerate(chunk):
                b.token[i] = t
                b.pos[i] = base + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                want_row = (start + i) in want
                b.logits[i] = want_row
                if want_row:
                    chunk_rows.append(i)
            t0 = time.perf_counter()
            rc = _ll.llama_decode(self._ctx, b)
            self.decode_s += time.perf_counter() - t0
            self.decode_calls += 1
            if rc != 0:
                # llama.cpp restores the memory state on failure
                raise DecodeError(f"{self.name}: llama_decode failed (code {rc})")
            self.tokens.extend(int(t) for t in chunk)
            if chunk_rows:
                ptr = _ll.llama_get_logits(self._ctx)
                arr = np.ctypeslib.as_array(ptr, shape=(len(chunk_rows), self.n_vocab))
                out.append(np.array(arr, copy=True) if (copy or start + m < n) else arr)
            start += m
        if not out:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        return out[0] if len(out) == 1 else np.concatenate(out, axis=0)

    def sync(self, context: Sequence[int], copy: bool = True) -> np.ndarray:
        """Make the cache hold exactly `context` (reusing the common prefix); return the last row's logits."""
        common = common_prefix(self.tokens, context)
        if common == len(context):  # everything cached: re-decode the last token for its logits
            common -= 1
        self.truncate(common)
        self.reused = common
        return self.decode(context[common:], "last", copy=copy)[0]

    # ------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if _ll is None:
            return
        if getattr(self, "_batch", None) is not None:
            _ll.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            _ll.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            _ll.llama_model_free(self._model)
            self._model = None
            self._release_rpc()

    def _release_rpc(self) -> None:
        for ep in getattr(self, "rpc_servers", ()):
            if ep in _rpc_in_use:
                _rpc_in_use.remove(ep)

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _LazyTokenText(Sequence):
    """token id -> text bytes without materialising 150k strings up front."""

    def __init__(self, model: Model) -> None:
        self._m = model

    def __len__(self) -> int:
        return self._m.n_vocab

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._m.token_text(j) for j in range(*i.indices(len(self)))]
        return self._m.token_text(i)
