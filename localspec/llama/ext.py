"""ctypes declarations for llama.cpp's staging header `src/llama-ext.h` (the hidden-state calls the draft heads need).

These functions are exported with C++-mangled names ("breaking changes allowed" upstream), so each is looked up
under its plain name, its Itanium (Linux/macOS) name and its MSVC name; a missing symbol is not an error here:
`missing()` lists what this build lacks and `heads_available()` says, per head, whether it can run and why not.
llama-cpp-python's own `llama_cpp.llama_cpp_ext` binds five of these but raises at import when one is missing,
so the lookup is done here, one symbol at a time, the same way.

Struct offsets: the fields the heads set (`llama_model_params.load_mtp`, `llama_context_params.ctx_type` and
`ctx_other`) are declared by llama-cpp-python 0.3.36; `layout_ok()` checks them against llama.h's offsetof.
"""

from __future__ import annotations

import ctypes
from typing import Any

from localspec.llama import lib

# (name, itanium, msvc), argtypes, restype
_c = ctypes.c_void_p  # llama_context * / llama_model *
_F = ctypes.POINTER(ctypes.c_float)
_I32P = ctypes.POINTER(ctypes.c_int32)
SIGNATURES: dict[str, tuple[tuple[str, ...], list, Any]] = {
    "llama_set_embeddings_nextn": (
        ("_Z26llama_set_embeddings_nextnP13llama_contextbb", "?llama_set_embeddings_nextn@@YAXPEAUllama_context@@_N1@Z"),
        [_c, ctypes.c_bool, ctypes.c_bool], None),
    "llama_set_nextn_layer_offset": (
        ("_Z28llama_set_nextn_layer_offsetP13llama_contexti", "?llama_set_nextn_layer_offset@@YAXPEAUllama_context@@H@Z"),
        [_c, ctypes.c_int32], None),
    "llama_get_embeddings_nextn": (
        ("_Z26llama_get_embeddings_nextnP13llama_context", "?llama_get_embeddings_nextn@@YAPEAMPEAUllama_context@@@Z"),
        [_c], _F),
    "llama_get_embeddings_nextn_ith": (
        ("_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
         "?llama_get_embeddings_nextn_ith@@YAPEAMPEAUllama_context@@H@Z"),
        [_c, ctypes.c_int32], _F),
    "llama_set_embeddings_layer_inp": (
        ("_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
         "?llama_set_embeddings_layer_inp@@YAXPEAUllama_context@@I_N@Z"),
        [_c, ctypes.c_uint32, ctypes.c_bool], None),
    "llama_get_embeddings_layer_inp": (
        ("_Z30llama_get_embeddings_layer_inpP13llama_contextj",
         "?llama_get_embeddings_layer_inp@@YAPEAMPEAUllama_context@@I@Z"),
        [_c, ctypes.c_uint32], _F),
    "llama_get_ctx_other": (
        ("_Z19llama_get_ctx_otherP13llama_context", "?llama_get_ctx_other@@YAPEAUllama_context@@PEAU1@@Z"),
        [_c], _c),
    "llama_model_dflash_selector_top_k": (
        ("_Z33llama_model_dflash_selector_top_kPK11llama_model",
         "?llama_model_dflash_selector_top_k@@YAHPEBUllama_model@@@Z"),
        [_c], ctypes.c_int32),
    "llama_model_target_layer_ids": (
        ("_Z28llama_model_target_layer_idsPK11llama_model", "?llama_model_target_layer_ids@@YAPEBHPEBUllama_model@@@Z"),
        [_c], _I32P),
    "llama_model_target_layer_ids_n": (
        ("_Z30llama_model_target_layer_ids_nPK11llama_model", "?llama_model_target_layer_ids_n@@YAIPEBUllama_model@@@Z"),
        [_c], ctypes.c_uint32),
}

# what each head calls (besides llama.h's public API: llama_process, llama_batch_ext_*)
NEEDS = {
    "eagle3": ("llama_set_embeddings_layer_inp", "llama_get_embeddings_layer_inp", "llama_set_embeddings_nextn",
               "llama_get_embeddings_nextn", "llama_get_embeddings_nextn_ith", "llama_model_target_layer_ids",
               "llama_model_target_layer_ids_n"),
    "mtp": ("llama_set_embeddings_nextn", "llama_get_embeddings_nextn", "llama_get_embeddings_nextn_ith"),
    "dflash": ("llama_set_embeddings_layer_inp", "llama_get_embeddings_layer_inp", "llama_set_embeddings_nextn",
               "llama_model_target_layer_ids", "llama_model_target_layer_ids_n", "llama_model_dflash_selector_top_k"),
    # DFlash plus the confidence head's output, which llama.cpp hands out as the nextn embeddings
    "dspark": ("llama_set_embeddings_layer_inp", "llama_get_embeddings_layer_inp", "llama_set_embeddings_nextn",
               "llama_get_embeddings_nextn", "llama_model_target_layer_ids", "llama_model_target_layer_ids_n",
               "llama_model_dflash_selector_top_k"),
}
# public llama.h calls (bound by llama-cpp-python itself) the heads need
PUBLIC = ("llama_process", "llama_batch_ext_init", "llama_batch_ext_free", "llama_batch_ext_clear",
          "llama_batch_ext_add_token", "llama_batch_ext_add_embd", "llama_batch_ext_set_embd_token",
          "llama_batch_ext_set_embd_state", "llama_batch_ext_set_pos", "llama_batch_ext_set_output_logits")

# llama.h at llama-cpp-python 0.3.36 (offsetof / sizeof, measured with a C compiler against the vendored header)
LAYOUT = {
    "llama_model_params": (80, {"load_mtp": 77}),
    "llama_context_params": (160, {"ctx_type": 36, "ctx_other": 152}),
}

_funcs: dict[str, Any] = {}
_missing: list[str] | None = None


def _library():
    ll = lib.require()
    return ll.llama_cpp._lib  # the CDLL llama-cpp-python loaded


def _resolve() -> None:
    global _missing
    if _missing is not None:
        return
    missing = []
    try:
        dll = _library()
    except Exception:  # no llama_cpp at all: everything is missing
        _missing = list(SIGNATURES) + list(PUBLIC)
        return
    for name, (mangled, argtypes, restype) in SIGNATURES.items():
        for sym in (name, *mangled):
            try:
                f = getattr(dll, sym)
            except AttributeError:
                continue
            f.argtypes = argtypes
            f.restype = restype
            _funcs[name] = f
            break
        else:
            missing.append(name)
    ll = lib.ll
    missing += [n for n in PUBLIC if not hasattr(ll, n)]
    _missing = missing


def missing() -> list[str]:
    """The llama-ext.h / llama.h calls this build lacks."""
    _resolve()
    return list(_missing or [])


def layout_ok() -> str | None:
    """None when llama-cpp-python's ctypes structs put the head fields where llama.h does; else why not."""
    ll = lib.require()
    for struct, (size, fields) in LAYOUT.items():
        cls = getattr(ll, struct, None)
        if cls is None:
            return f"{struct} is not declared by llama-cpp-python"
        if ctypes.sizeof(cls) != size:
            return f"{struct} is {ctypes.sizeof(cls)} bytes in llama-cpp-python, {size} in llama.h"
        for f, off in fields.items():
            got = getattr(cls, f, None)
            if got is None or got.offset != off:
                return f"{struct}.{f} is not at offset {off} (llama.h) in llama-cpp-python's declaration"
    return None


def heads_available() -> dict[str, str | None]:
    """{head: None (available) or the reason it is not}, checked once against the loaded library."""
    try:
        lib.require()
    except Exception as exc:
        return {h: str(exc) for h in NEEDS}
    gone = set(missing())
    bad_layout = layout_ok()
    out: dict[str, str | None] = {}
    for head, needs in NEEDS.items():
        lacking = [n for n in (*needs, *PUBLIC) if n in gone]
        if lacking:
            out[head] = (f"this llama-cpp-python build lacks {', '.join(lacking)} "
                         f"(llama-cpp-python {getattr(lib.ll, '__version__', '?')}; localspec supports 0.3.36)")
        elif bad_layout:
            out[head] = bad_layout
        else:
            out[head] = None
    return out


def fn(name: str):
    """The bound function `name` (KeyError when missing: callers check heads_available() first)."""
    _resolve()
    return _funcs[name]
