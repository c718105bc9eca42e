"""The llama-level pieces of llama.cpp's draft heads (EAGLE-3, MTP): a head GGUF loaded without a context, a second
context on a model (an MTP context on the target's own model, or an EAGLE-3 context whose `ctx_other` is the
target's), batches that carry a token and an embedding per row (llama_batch_ext + llama_process), and reads of the
target's hidden states (layer inputs, the nextn/pre-norm state), which live only until the target's next decode.

Everything here is as common/speculative.cpp does it at the vendored commit (llama-cpp-python 0.3.36).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from localspec.errors import DecodeError, IncompatibleDraftError, ModelLoadError
from localspec.llama import ext, ggml, gguf_keys, lib
from localspec.llama.headarchs import HEAD_ARCHS, LAYER_INP_ARCHS  # noqa: F401 - part of this module's API
from localspec.llama.model import GGML_TYPES

CONTEXT_TYPE_DEFAULT = 0
CONTEXT_TYPE_MTP = 1
PROCESS_ENCODE = 0
PROCESS_DECODE = 1


def meta_str(model_ptr, key: str) -> str | None:
    ll = lib.require()
    buf = ctypes.create_string_buffer(256)
    n = ll.llama_model_meta_val_str(model_ptr, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n >= 0 else None


def arch_of(model_ptr) -> str:
    return meta_str(model_ptr, "general.architecture") or "?"


# heads that no method is named after, as the messages name them (a DSpark head runs as --method dflash)
HEAD_LABELS = {"dspark": "a DSpark head (--method dflash)"}


def require_head(kind: str) -> None:
    """Raise IncompatibleDraftError (one line) when this llama-cpp-python build cannot run head `kind`."""
    why = ext.heads_available().get(kind, f"unknown draft head {kind!r}")
    if why:
        raise IncompatibleDraftError(f"{HEAD_LABELS.get(kind, f'--method {kind}')} is unavailable: {why}")


def check_layer_inp_target(target, kind: str, layer_ids: Sequence[int]) -> None:
    """Refuse (one line, before any flag is set) a target whose graph would abort on layer-input extraction."""
    arch = arch_of(target._model)
    if arch not in LAYER_INP_ARCHS:
        raise IncompatibleDraftError(
            f"{kind} needs the target's layer hidden states, which llama.cpp does not extract for {arch}-arch "
            f"models like {target.name} (supported: {', '.join(sorted(LAYER_INP_ARCHS))})")
    n_layer = n_layer_of(target._model)
    bad = [i for i in layer_ids if not 0 <= i < n_layer]
    if bad:
        raise IncompatibleDraftError(f"the {kind} draft reads target layers {list(layer_ids)}, but {target.name} has "
                                     f"{n_layer} layers")


def n_nextn_of(model_ptr) -> int:
    """How many MTP (nextn) layers a model's GGUF declares ({arch}.nextn_predict_layers; 0: none)."""
    v = meta_str(model_ptr, f"{arch_of(model_ptr)}.nextn_predict_layers")
    try:
        return int(v) if v else 0
    except ValueError:
        return 0


def file_nextn(path: str | os.PathLike) -> int:
    """{arch}.nextn_predict_layers of a GGUF file, read from its header (0: none or unreadable)."""
    meta = gguf_keys.metadata(path)
    try:
        return int(meta.get(f"{meta.get('general.architecture', '')}.nextn_predict_layers", 0))
    except (TypeError, ValueError):
        return 0


def n_layer_of(model_ptr) -> int:
    return int(lib.require().llama_model_n_layer(model_ptr))


def n_embd_of(model_ptr) -> int:
    return int(lib.require().llama_model_n_embd(model_ptr))


def n_vocab_of(model_ptr) -> int:
    ll = lib.require()
    return int(ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model_ptr)))


def target_layer_ids(model_ptr) -> list[int]:
    n = int(ext.fn("llama_model_target_layer_ids_n")(model_ptr))
    ptr = ext.fn("llama_model_target_layer_ids")(model_ptr)
    return [int(ptr[i]) for i in range(n)] if n and ptr else []


def file_arch(path: str | os.PathLike) -> str | None:
    """general.architecture of a GGUF file, read from its header without loading it (None: unreadable)."""
    arch = gguf_keys.metadata(path).get("general.architecture")
    return arch if isinstance(arch, str) else None


class HeadModel:
    """A draft-head GGUF (eagle3, dflash, dspark) loaded without a context of its own: its context needs the
    target's."""

    def __init__(self, path: str | os.PathLike, *, n_gpu_layers: int = 0) -> None:
        ll = lib.require()
        ggml.ready()
        self.path = Path(path)
        self._model = None
        if not self.path.is_file():
            raise ModelLoadError(f"model file not found: {self.path}")
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = int(n_gpu_layers)
        with lib.DeferSignals():
            self._model = ll.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {self.path} (corrupt, truncated or unsupported GGUF)")
        self.arch = arch_of(self._model)
        self.n_embd = n_embd_of(self._model)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def model_handle(self):
        """The llama_model pointer, for the calls in this module that read or run the head."""
        return self._model

    def size_bytes(self) -> int:
        return int(lib.ll.llama_model_size(self._model))

    def close(self) -> None:
        if self._model and lib.ll is not None:
            lib.ll.llama_model_free(self._model)
        self._model = None

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


class HeadContext:
    """A llama.cpp context for a draft head: rows of (token, embedding) decoded with llama_process."""

    def __init__(self, model_ptr, *, n_ctx: int, n_batch: int, n_threads: int, kv_type: str = "bf16",
                 ctx_type: int = CONTEXT_TYPE_DEFAULT, ctx_other=None, name: str = "head") -> None:
        ll = lib.require()
        self.name = name
        self._ctx = None
        self._batch = None
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = int(n_ctx)
        cparams.n_batch = cparams.n_ubatch = int(n_batch)
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = int(n_threads)
        cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cparams.type_k = cparams.type_v = GGML_TYPES.get(kv_type, GGML_TYPES["bf16"])
        cparams.no_perf = True
        cparams.ctx_type = int(ctx_type)
        if ctx_other is not None:
            cparams.ctx_other = ctx_other
        with lib.DeferSignals():
            self._ctx = ll.llama_init_from_model(model_ptr, cparams)
        if not self._ctx:
            raise ModelLoadError(f"could not create the {name} context")
        self._mem = ll.llama_get_memory(self._ctx)
        self._batch = ll.llama_batch_ext_init(self._ctx)
        self.n_vocab = int(ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model_ptr)))
        self.n_ubatch = int(ll.llama_n_ubatch(self._ctx))
        self._pos = (ctypes.c_int32 * 4)()
        self._keep: list = []

    @property
    def ctx(self):
        return self._ctx

    def seq_rm(self, p0: int) -> None:
        lib.ll.llama_memory_seq_rm(self._mem, 0, int(p0), -1)

    def pos_max(self) -> int:
        return int(lib.ll.llama_memory_seq_pos_max(self._mem, 0))

    def clear(self) -> None:
        lib.ll.llama_memory_clear(self._mem, True)

    def prepare(self, first: int) -> None:
        """Make the next rows, from position `first` on, decodable: drop what the cache holds from there, and all
        of it when it stops short of first - 1 (llama.cpp wants positions to continue the cache; the hidden states
        of the gap are gone, which costs acceptance, never correctness)."""
        self.seq_rm(first)
        last = self.pos_max()
        if last >= 0 and last != first - 1:
            self.clear()

    def process(self, kind: int, rows: Sequence[tuple[int | None, int, np.ndarray | None, bool]]) -> None:
        """Decode (or encode) rows of (token or None, pos, embedding row or None, output?)."""
        ll = lib.ll
        b = self._batch
        ll.llama_batch_ext_clear(b)
        keep = []
        for tok, pos, emb, out in rows:
            if emb is not None:
                emb = np.ascontiguousarray(emb, dtype=np.float32)
                keep.append(emb)
                e = ll.llama_embd(emb.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, emb.shape[-1])
            if tok is None:
                idx = ll.llama_batch_ext_add_embd(b, 0, e)
            else:
                idx = ll.llama_batch_ext_add_token(b, 0, int(tok))
            if idx < 0:
                raise DecodeError(f"{self.name}: could not add a row to the batch (error {idx})")
            self._pos[0] = int(pos)
            ll.llama_batch_ext_set_pos(b, idx, self._pos)
            if tok is not None and emb is not None and not ll.llama_batch_ext_set_embd_token(b, idx, e):
                raise DecodeError(f"{self.name}: could not attach an embedding to a row")
            if out:
                ll.llama_batch_ext_set_output_logits(b, idx, True)
        rc = ll.llama_process(self._ctx, int(kind), b)
        del keep
        if rc != 0:
            raise DecodeError(f"{self.name}: llama_process failed (code {rc})")

    def logits(self, i: int) -> np.ndarray:
        ptr = lib.ll.llama_get_logits_ith(self._ctx, int(i))
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def nextn(self, n_rows: int, n_embd: int) -> np.ndarray:
        """The first n_rows rows of the pre-norm (nextn) embeddings of the last process (a copy)."""
        ptr = ext.fn("llama_get_embeddings_nextn")(self._ctx)
        if not ptr:
            raise DecodeError(f"{self.name}: no nextn embeddings")
        return np.ctypeslib.as_array(ptr, shape=(n_rows, n_embd)).copy()

    def nextn_ith(self, i: int, n_embd: int) -> np.ndarray:
        ptr = ext.fn("llama_get_embeddings_nextn_ith")(self._ctx, int(i))
        if not ptr:
            raise DecodeError(f"{self.name}: no nextn embedding for row {i}")
        return np.ctypeslib.as_array(ptr, shape=(n_embd,)).copy()

    def close(self) -> None:
        ll = lib.ll
        if ll is None:
            return
        if self._batch is not None:
            ll.llama_batch_ext_free(self._batch)
            self._batch = None
        if self._ctx:
            ll.llama_free(self._ctx)
            self._ctx = None

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


def enable_layer_inp(ctx, layer_ids: Sequence[int]) -> None:
    f = ext.fn("llama_set_embeddings_layer_inp")
    for lid in layer_ids:
        f(ctx, int(lid), True)


def layer_inp_rows(ctx, lid: int, n_rows: int, n_embd: int) -> np.ndarray:
    """The input of layer `lid` for the n_rows tokens of the context's last decode (a view: copy before the next)."""
    ptr = ext.fn("llama_get_embeddings_layer_inp")(ctx, int(lid))
    if not ptr:
        raise DecodeError(f"no hidden states of layer {lid} were extracted")
    return np.ctypeslib.as_array(ptr, shape=(n_rows, n_embd))


def set_nextn(ctx, value: bool, masked: bool) -> None:
    ext.fn("llama_set_embeddings_nextn")(ctx, bool(value), bool(masked))


def nextn_rows(ctx, n_rows: int, n_embd: int) -> np.ndarray:
    ptr = ext.fn("llama_get_embeddings_nextn")(ctx)
    if not ptr:
        raise DecodeError("no nextn hidden states were extracted")
    return np.ctypeslib.as_array(ptr, shape=(n_rows, n_embd))


def has_tensor(path: str | os.PathLike, name: str) -> bool:
    """Whether a GGUF file holds tensor `name`, read from its header (False: it does not or is unreadable)."""
    try:
        import gguf

        return any(t.name == name for t in gguf.GGUFReader(str(path)).tensors)
    except Exception:
        return False
