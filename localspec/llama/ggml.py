"""ggml's backend registry, devices, the RPC backend and the abort callback. llama-cpp-python binds libllama only;
these come from the ggml libraries next to it in llama_cpp/lib/ (prototypes from ggml-backend.h), through one loader
and one signature table."""

from __future__ import annotations

import ctypes
import os
import re
import sys
from typing import Sequence

from localspec.errors import ModelLoadError
from localspec.knobs import knobs
from localspec.llama import aborts, lib
from localspec import rpcwire as rpc

DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}
DEV_CPU, DEV_GPU = 0, 1
_c = ctypes
_SIGS = {
    "ggml_backend_reg_count": (_c.c_size_t, []),
    "ggml_backend_reg_get": (_c.c_void_p, [_c.c_size_t]),
    "ggml_backend_reg_name": (_c.c_char_p, [_c.c_void_p]),
    "ggml_backend_reg_by_name": (_c.c_void_p, [_c.c_char_p]),
    "ggml_backend_reg_get_proc_address": (_c.c_void_p, [_c.c_void_p, _c.c_char_p]),
    "ggml_backend_reg_dev_count": (_c.c_size_t, [_c.c_void_p]),
    "ggml_backend_reg_dev_get": (_c.c_void_p, [_c.c_void_p, _c.c_size_t]),
    "ggml_backend_dev_count": (_c.c_size_t, []),
    "ggml_backend_dev_get": (_c.c_void_p, [_c.c_size_t]),
    "ggml_backend_dev_type": (_c.c_int, [_c.c_void_p]),
    "ggml_backend_dev_name": (_c.c_char_p, [_c.c_void_p]),
    "ggml_backend_dev_description": (_c.c_char_p, [_c.c_void_p]),
    "ggml_backend_dev_memory": (None, [_c.c_void_p, _c.POINTER(_c.c_size_t), _c.POINTER(_c.c_size_t)]),
    "ggml_backend_dev_backend_reg": (_c.c_void_p, [_c.c_void_p]),
    "ggml_set_abort_callback": (_c.c_void_p, [_c.c_void_p]),
}
_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
_START_SERVER = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                 ctypes.POINTER(ctypes.c_void_p))
_ABORT_CB_T = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_ggml_libs: list | None = None
_fn_cache: dict = {}
_abort_cb = None


def ready() -> None:
    """llama.cpp's backend started, with localspec's abort handler installed (not under LOCALSPEC_DEBUG)."""
    lib.init_backend()
    if not lib.DEBUG:
        _install_abort_handler()


def _text(b: bytes | None) -> str:
    return (b or b"").decode("utf-8", "replace")


def compiled_backends() -> list[str]:
    """The ggml backends this build registered (e.g. CPU, CUDA, Metal, RPC)."""
    ready()
    name, get = _ggml("ggml_backend_reg_name"), _ggml("ggml_backend_reg_get")
    return [_text(name(get(i))) for i in range(_ggml("ggml_backend_reg_count")())]


def devices() -> list[dict]:
    """Every device llama.cpp can run on: name, description, type (cpu | gpu | igpu | accel), backend, free and
    total memory in bytes."""
    ready()
    f = {n: _ggml(f"ggml_backend_{n}") for n in ("dev_count", "dev_get", "dev_memory", "dev_type", "dev_name",
                                                   "dev_description", "dev_backend_reg", "reg_name")}
    out = []
    for i in range(f["dev_count"]()):
        dev = f["dev_get"](i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        f["dev_memory"](dev, ctypes.byref(free), ctypes.byref(total))
        kind = int(f["dev_type"](dev))
        out.append({
            "name": _text(f["dev_name"](dev)),
            "description": _text(f["dev_description"](dev)),
            "type": DEVICE_TYPES.get(kind, str(kind)),
            "backend": _text(f["reg_name"](f["dev_backend_reg"](dev))),
            "memory_free": int(free.value),
            "memory_total": int(total.value),
        })
    return out


def _ggml(name: str):
    """A ggml C function from llama_cpp/lib (libggml-base or libggml), typed from _SIGS; None if absent."""
    global _ggml_libs
    if name in _fn_cache:
        return _fn_cache[name]
    lib.require()
    if _ggml_libs is None:
        _ggml_libs = []
        for path in _loaded_ggml_paths():
            try:
                _ggml_libs.append(ctypes.CDLL(path))
            except OSError:
                pass
    fn = None
    for handle in _ggml_libs:
        f = getattr(handle, name, None)
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
    ready()
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


def local_devices(types: set[int]) -> list[int]:
    count, get, typ = _ggml("ggml_backend_dev_count"), _ggml("ggml_backend_dev_get"), _ggml("ggml_backend_dev_type")
    return [d for d in (get(i) for i in range(count())) if typ(d) in types]


def rpc_start_server(endpoint: str, cache_dir: str | None, n_threads: int) -> None:
    """llama.cpp's RPC server on endpoint (IPv4 HOST:PORT), serving this machine's GPUs, else its CPU.
    Blocks for as long as it serves (the GIL is released); returns only when it cannot listen."""
    start = _START_SERVER(_need_rpc("ggml_backend_rpc_start_server"))
    devices = local_devices({DEV_GPU}) or local_devices({DEV_CPU})  # as llama.cpp's rpc-server chooses
    if not devices:
        raise ModelLoadError("llama.cpp found no device to serve")
    arr = (ctypes.c_void_p * len(devices))(*devices)
    if not knobs().llama_log:
        ll = lib.require()

        @ll.llama_log_callback
        def _errors_only(level, text, user_data):  # noqa: ARG001 - a worker shows llama.cpp's errors
            if level == 4 and text:  # GGML_LOG_LEVEL_ERROR
                sys.stderr.write(text.decode("utf-8", "replace"))
                sys.stderr.flush()

        lib.set_log_callback(_errors_only)
    start(endpoint.encode(), cache_dir.encode() if cache_dir else None, int(n_threads), len(devices), arr)


def rpc_devices(servers: Sequence[str]) -> list[int]:
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


def _install_abort_handler() -> None:
    global _abort_cb
    setter = _ggml("ggml_set_abort_callback")
    if setter is None or _abort_cb is not None:
        return
    _abort_cb = _ABORT_CB_T(aborts.on_ggml_abort)
    setter(ctypes.cast(_abort_cb, ctypes.c_void_p))
