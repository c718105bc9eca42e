"""The one module that imports llama_cpp. Everything above talks to `Model`.

Low-level API only: a batch decode returns logits for the rows asked for (never logits_all),
KV entries are removed with llama_memory_seq_rm, flash attention is forced on (with it off a row's
logits depend on the batch size, which breaks exactness between plain and speculative decoding).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from .errors import DecodeError, ModelLoadError
from .seq import common_prefix

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


def _init_backend() -> None:
    global _backend_ready, _log_cb
    ll = _require()
    with _backend_lock:
        if _backend_ready:
            return
        if not os.environ.get("LOCALSPEC_LLAMA_LOG"):
            # silence llama.cpp's chatter on stderr (stderr belongs to our status line)
            @ll.llama_log_callback
            def _quiet(level, text, user_data):  # noqa: ARG001
                return None

            _log_cb = _quiet
            ll.llama_log_set(_log_cb, ctypes.c_void_p(0))
        ll.llama_backend_init()
        _backend_ready = True


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


def _ggml():
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
    lib = _ggml()
    return [_text(lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i))) for i in range(lib.ggml_backend_reg_count())]


def devices() -> list[dict]:
    """Every device llama.cpp can run on: name, description, type (cpu | gpu | igpu | accel), backend, free and
    total memory in bytes."""
    lib = _ggml()
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


GGML_TYPES = {"f16": 1, "q8_0": 8, "bf16": 30}

VOCAB_TYPES = {0: "none", 1: "spm", 2: "bpe", 3: "wpm", 4: "ugm", 5: "rwkv", 6: "plamo2"}


@dataclass
class VocabInfo:
    """Facts used by the pair check; built from a loaded model or from a GGUF header."""

    vocab_type: str
    n_vocab: int
    bos: int
    eos: int
    add_bos: bool
    add_eos: bool
    token_text: Sequence[bytes] = field(repr=False, default_factory=list)


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
    ) -> None:
        ll = _require()
        _init_backend()
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"model file not found: {self.path}")
        with open(self.path, "rb") as fh:
            if fh.read(4) != b"GGUF":
                raise ModelLoadError(f"not a GGUF file (bad magic): {self.path}")
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = int(n_gpu_layers)
        self.n_gpu_layers = int(n_gpu_layers)
        if os.environ.get("LOCALSPEC_NO_REPACK"):
            # work-around for CPUs where the native build's AMX path crashes (see README)
            mparams.use_extra_bufts = False
        self._model = ll.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {self.path} (corrupt, truncated or unsupported GGUF)")
        self._ctx = None
        self._batch = None
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
            kv = os.environ.get("LOCALSPEC_KV_TYPE") or ("bf16" if self.n_gpu_layers == 0 else "f16")
            if kv not in GGML_TYPES:
                raise ModelLoadError(f"LOCALSPEC_KV_TYPE must be one of {', '.join(GGML_TYPES)}, got {kv!r}")
            self.kv_type = kv
            cparams.type_k = cparams.type_v = GGML_TYPES[kv]
            cparams.no_perf = True
            self._ctx = ll.llama_init_from_model(self._model, cparams)
            if not self._ctx:
                raise ModelLoadError(f"could not create a context of {n_ctx} tokens for {self.path.name}")
            self.n_ctx = int(ll.llama_n_ctx(self._ctx))
            self.n_batch = int(ll.llama_n_batch(self._ctx))  # llama.cpp caps it at n_ctx
            self._mem = ll.llama_get_memory(self._ctx)
            self._batch = ll.llama_batch_init(self.n_batch, 0, 1)
        except Exception:
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

    def meta(self, key: str) -> str | None:
        ll = _ll
        buf = ctypes.create_string_buffer(4096)
        n = ll.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        return buf.value.decode("utf-8", "replace")

    def description(self) -> str:
        buf = ctypes.create_string_buffer(256)
        _ll.llama_model_desc(self._model, buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def size_bytes(self) -> int:
        return int(_ll.llama_model_size(self._model))

    def n_params(self) -> int:
        return int(_ll.llama_model_n_params(self._model))

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

    def is_recurrent(self) -> bool:
        return bool(_ll.llama_model_is_recurrent(self._model) or _ll.llama_model_is_hybrid(self._model))

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

    def apply_chat_template(self, messages: Sequence[dict], add_assistant: bool = True) -> str | None:
        """Render messages with the model's template (llama.cpp's built-in matcher). None if unsupported."""
        tmpl = self.chat_template()
        if tmpl is None:
            return None
        enc = [(m["role"].encode(), m["content"].encode()) for m in messages]
        arr = (_ll.llama_chat_message * len(enc))()
        for i, (r, c) in enumerate(enc):
            arr[i].role = r
            arr[i].content = c
        size = 2 * sum(len(c) + len(r) for r, c in enc) + 1024
        buf = ctypes.create_string_buffer(size)
        n = _ll.llama_chat_apply_template(tmpl.encode(), arr, len(enc), add_assistant, buf, size)
        if n < 0:
            return None
        if n > size:
            buf = ctypes.create_string_buffer(n + 1)
            n = _ll.llama_chat_apply_template(tmpl.encode(), arr, len(enc), add_assistant, buf, n + 1)
        return buf.raw[:n].decode("utf-8", "replace")

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
        if self._batch is not None:
            _ll.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            _ll.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            _ll.llama_model_free(self._model)
            self._model = None

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
