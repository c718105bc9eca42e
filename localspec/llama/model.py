"""A loaded GGUF model: one context (sequence 0), a token-tracked KV cache, batched decode.

Low-level API only: a batch decode returns logits for the rows asked for (never logits_all),
KV entries are removed with llama_memory_seq_rm, flash attention is forced on (with it off a row's
logits depend on the batch size, which breaks exactness between plain and speculative decoding).

Rollback (`truncate`) by model kind (`rollback_kind`):
- "kv": a transformer; rejected tokens' KV cells are removed with llama_memory_seq_rm.
- "rs": a recurrent/hybrid arch that keeps `n_rs_seq` recurrent-state planes (llama.cpp's RS rollback: QWEN35(MOE),
  NEMOTRON_H(_MOE), LFM2(MOE), BAILINGMOE3, ...): removing 1..min(n_rs_seq, batch - 1) tail tokens of the LAST
  decode just selects a plane. Anything else (the whole last batch, a second rollback without a decode between,
  more than n_rs_seq tokens: llama.cpp answers true there but leaves a stale state) takes the checkpoint path.
- "checkpoint": every other recurrent/hybrid arch (Mamba, Mamba2, Jamba, Falcon-H1, Granite-H, Qwen3-Next, RWKV,
  ...): the recurrent state saved before the last multi-token decode (`llama_state_seq_get_data_ext`, PARTIAL_ONLY:
  only the recurrent part of a hybrid, in one reused buffer) is restored, the attention cells from that position
  on are removed, and the accepted tokens after it are decoded again (the replay).
- "none": neither works here: the engine decodes plainly.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from localspec.errors import DecodeCancelled, DecodeError, ModelLoadError, UsageError
from localspec.knobs import knobs
from localspec.llama import aborts, ggml, lib
from localspec.llama.lib import ll as _ll
from localspec.llama.seqstate import SeqStates, roll_back
from localspec.llama.threads import check_threads, default_threads
from localspec.llama.tokens import Tokens
from localspec import rpcwire as rpc
from localspec.seq import common_prefix

GGML_TYPES = {"f16": 1, "q8_0": 8, "bf16": 30}

ROLLBACK_KINDS = ("kv", "rs", "checkpoint", "none")
RS_SEQ = 8  # recurrent-state planes asked for (k <= 8 verifies roll back without a checkpoint restore)


def _rs_seq_wanted() -> int:
    n = knobs().rs_seq
    return RS_SEQ if n is None else n


class Model(Tokens):
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
        load_mtp: bool = False,
    ) -> None:
        """rpc_servers: llama.cpp RPC workers ("HOST:PORT") that take this model's layers (all of them unless
        n_gpu_layers says how many; the rest stay on the local CPU), in tensor_split proportions (one per
        device: the workers' devices in order, then local GPUs; default: by free memory)."""
        check_threads(n_threads)  # before llama.cpp sees it: 100000 threads crash it, 1000 hang it
        ll = lib.require()
        ggml.ready()
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
            local_gpus = ggml.local_devices({ggml.DEV_GPU})
            devices = ggml.rpc_devices(self.rpc_servers) + local_gpus  # llama.cpp's order: RPC first
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
        if load_mtp:  # the target's MTP (nextn) layers, for an MTP draft context on this model (llama/heads.py)
            mparams.load_mtp = True
        self.n_gpu_layers = int(n_gpu_layers)
        if knobs().no_repack:
            # work-around for CPUs where the native build's AMX path crashes (see README)
            mparams.use_extra_bufts = False
        if self.rpc_servers:
            aborts.rpc_in_use.extend(self.rpc_servers)
        deferred = lib.DeferSignals()  # Ctrl-C aborts the load (through the progress callback) and is re-raised
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
            kv = knobs().kv_type or ("bf16" if on_cpu else "f16")
            self.kv_type = kv
            cparams.type_k = cparams.type_v = GGML_TYPES[kv]
            cparams.no_perf = True
            self.is_recurrent = bool(ll.llama_model_is_recurrent(self._model))
            self.is_hybrid = bool(ll.llama_model_is_hybrid(self._model))
            # LOCALSPEC_ROLLBACK=checkpoint|none forces a rollback kind on recurrent/hybrid models (benchmarks, tests)
            forced = knobs().rollback
            if (self.is_recurrent or self.is_hybrid) and forced not in ("checkpoint", "none"):
                cparams.n_rs_seq = _rs_seq_wanted()
            with lib.DeferSignals():
                self._ctx = ll.llama_init_from_model(self._model, cparams)
            if not self._ctx:
                raise ModelLoadError(f"could not create a context of {n_ctx} tokens for {self.path.name}")
            self.n_ctx = int(ll.llama_n_ctx(self._ctx))
            self.n_batch = int(ll.llama_n_batch(self._ctx))  # llama.cpp caps it at n_ctx
            self._mem = ll.llama_get_memory(self._ctx)
            self._batch = ll.llama_batch_init(self.n_batch, 0, 1)
            self.rs_seq = int(ll.llama_n_rs_seq(self._ctx)) if hasattr(ll, "llama_n_rs_seq") else 0
            self.rollback_kind = self._detect_rollback(forced)
        except BaseException:  # KeyboardInterrupt too: free what was allocated
            self.close()
            raise
        # a recurrent/hybrid state's checkpoint, planes and rollback counters (sequence 0; llama/seqstate.py)
        self._states = SeqStates(self._ctx, 1)
        self.last_replay: tuple[list[int], int] = ([], 0)  # what the last truncate() replayed, and from where
        self.reused = 0  # prefix tokens the last sync() kept from the cache
        # the prefix of the cache a cold prefill would have computed the same way: whole n_batch chunks decoded from
        # position 0 (or a state of such a prefix restored); only its states are kept (core/prompt_cache.py)
        self.cold_upto = 0
        self.decode_s = 0.0  # time spent inside llama_decode (for overhead accounting in benchmarks)
        # set (a threading.Event) while a request's prompt is decoded: a long prompt stops between n_batch chunks once
        # it is set (DecodeCancelled), the chunks before kept in the cache (a client that left and retries reuses them)
        self.cancel_event = None
        self.tokens: list[int] = []  # tokens whose KV is in the cache, position i = tokens[i]
        self._piece_cache: dict[int, bytes] = {}
        self._special_piece_cache: dict[int, bytes] = {}

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

    @property
    def model_handle(self):
        """The llama_model pointer, for the llama.cpp calls of the draft heads (llama/heads.py) on this model."""
        return self._model

    @property
    def ctx_handle(self):
        """The llama_context pointer of sequence 0's context, for the draft heads' calls that read its hidden
        states (llama/heads.py)."""
        return self._ctx

    # -------------------------------------------------------------- the cache
    def _detect_rollback(self, forced: str) -> str:
        if not (self.is_recurrent or self.is_hybrid):
            return "kv"
        if forced == "none":
            return "none"
        if self.rs_seq > 0:
            return "rs"
        try:
            size = int(_ll.llama_state_seq_get_size_ext(self._ctx, 0, _ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY))
        except Exception:  # pragma: no cover - a build without the call
            return "none"
        return "checkpoint" if size > 0 else "none"

    @property
    def recurrent(self) -> bool:
        return self.rollback_kind != "kv"

    def rollback_counters(self) -> dict:
        """What rollback has cost so far (for Stats: take differences around a generation)."""
        return self._states.counters(0)

    def save_checkpoint(self) -> None:
        """Save the recurrent state at the current position (recurrent/hybrid models; a no-op otherwise). decode()
        does it before every multi-token decode; a caller about to make several one-token decodes it may roll back
        (a draft model's proposal) calls it first."""
        if self.rollback_kind in ("rs", "checkpoint"):
            self._states.save(0, len(self.tokens))

    def truncate(self, n_keep: int) -> list[int]:
        """Remove the cache's entries from position n_keep on (rollback of rejected tokens). Returns the tokens
        decoded again to get there (recurrent/hybrid models restoring a checkpoint; [] otherwise); they start
        at position `self.last_replay[1]`."""
        self.last_replay = ([], 0)
        if n_keep >= len(self.tokens):
            return []
        n_keep = max(int(n_keep), 0)
        self.cold_upto = min(self.cold_upto, n_keep)
        if n_keep == 0:
            self.clear()
            return []
        roll_back(self._states, self._mem, 0, n_keep, self.rollback_kind, self.rs_seq, self.name)
        start = self._states.done[0] if self.recurrent else n_keep
        replay = self.tokens[start:n_keep]
        del self.tokens[start:]
        if replay:  # a restored checkpoint (or none: from the start): the accepted tokens after it, decoded again
            self.decode(replay, [], _checkpoint=False)
            self._states.replayed[0] += len(replay)
        self.last_replay = (replay, start)
        return replay

    def state_bytes(self) -> bytes:
        """Sequence 0's KV state for the tokens the cache holds (`self.tokens`), as llama.cpp serializes it
        (llama_state_seq_get_data): what restore_state() puts back, in this process or another one with the same
        model file, build and settings (store/prompt_states.py keys it). b"" where there is nothing to save, or
        the model is not a plain transformer (rollback kind "kv": a recurrent state is not kept this way)."""
        if self.rollback_kind != "kv" or not self.tokens:
            return b""
        size = int(_ll.llama_state_seq_get_size(self._ctx, 0))
        if size <= 0:
            return b""
        buf = (ctypes.c_uint8 * size)()
        n = int(_ll.llama_state_seq_get_data(self._ctx, buf, size, 0))
        return ctypes.string_at(buf, n) if n > 0 else b""

    def restore_state(self, tokens: Sequence[int], data: bytes, cold: bool = False) -> bool:
        """Replace the cache with a state_bytes() state of `tokens`: the cache is cleared, `data` loaded into
        sequence 0 (llama_state_seq_set_data) and `self.tokens` set to `tokens`. False, with an empty cache, where
        llama.cpp refuses the bytes (another KV type or layer count, more cells than the context), they hold
        another number of tokens than `tokens`, or the model is recurrent/hybrid (rollback kind other than "kv":
        refused without a try). No logits are produced: the caller decodes at least the next token. `cold`: the
        state is of a prefix a cold prefill computes the same way (whole n_batch chunks from 0: `cold_upto`)."""
        tokens = [int(t) for t in tokens]
        if self.rollback_kind != "kv" or not tokens or not data or len(tokens) > self.n_ctx:
            if self.rollback_kind == "kv":
                self.clear()
            return False
        self.clear()
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        n = int(_ll.llama_state_seq_set_data(self._ctx, buf, len(data), 0))
        if (n <= 0 or int(_ll.llama_memory_seq_pos_min(self._mem, 0)) != 0
                or int(_ll.llama_memory_seq_pos_max(self._mem, 0)) != len(tokens) - 1):
            self.clear()
            return False
        self.tokens = tokens
        self.cold_upto = len(tokens) if cold and len(tokens) % self.n_batch == 0 else 0
        return True

    def clear(self) -> None:
        _ll.llama_memory_clear(self._mem, True)
        self.tokens.clear()
        self.cold_upto = 0
        if getattr(self, "_states", None) is not None:
            self._states.cleared(0)

    def decode(self, tokens: Sequence[int], logit_rows: Sequence[int] | str = "last", copy: bool = True,
               *, _checkpoint: bool = True) -> np.ndarray:
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
        if _checkpoint and n > 1 and self.rollback_kind in ("rs", "checkpoint"):
            self.save_checkpoint()  # what a rollback into (or past) this batch restores
        b = self._batch
        start = 0
        while start < n:
            ev = self.cancel_event
            if start and ev is not None and ev.is_set():
                raise DecodeCancelled(f"{self.name}: stopped after {start} of {n} tokens")
            chunk = tokens[start : start + self.n_batch]
            base = len(self.tokens)
            m = len(chunk)
            # a whole chunk at a multiple of n_batch after a cold prefix: as a cold prefill decodes it
            cold = base == self.cold_upto and m == self.n_batch and base % self.n_batch == 0
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
            if rc != 0:
                # llama.cpp restores the memory state on failure
                raise DecodeError(f"{self.name}: llama_decode failed (code {rc})")
            self.tokens.extend(int(t) for t in chunk)
            if cold and self.rollback_kind == "kv":
                self.cold_upto = base + m
            if self.recurrent:
                self._states.decoded([(0, m)], (0,))
            if chunk_rows:
                ptr = _ll.llama_get_logits(self._ctx)
                arr = np.ctypeslib.as_array(ptr, shape=(len(chunk_rows), self.n_vocab))
                out.append(np.array(arr, copy=True) if (copy or start + m < n) else arr)
            start += m
        if not out:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        return out[0] if len(out) == 1 else np.concatenate(out, axis=0)

    def fill(self, context: Sequence[int]) -> None:
        """Make the cache hold exactly `context` (reusing the common prefix), without logits: a prefill stopped at a
        point whose state is saved (core/prompt_cache.py) before the rest is decoded."""
        common = common_prefix(self.tokens, context)
        self.truncate(common)
        if len(context) > common:
            self.decode(context[common:], [])

    def sync(self, context: Sequence[int], copy: bool = True) -> np.ndarray:
        """Make the cache hold exactly `context` (reusing the common prefix); return the last row's logits."""
        common = common_prefix(self.tokens, context)
        if common == len(context):  # everything cached: re-decode the last token for its logits
            common -= 1
        self.truncate(common)
        self.reused = common
        rest = context[common:]
        if len(rest) > 1 and self.rollback_kind in ("rs", "checkpoint"):
            # a recurrent state cannot drop its last token: save it before the last one, so that the next sync of
            # the same context (a prefilled prompt, a regenerated answer) restores here instead of replaying
            self.decode(rest[:-1], [])
            self.save_checkpoint()
            rest = rest[-1:]
        return self.decode(rest, "last", copy=copy)[0]

    # ------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if _ll is None:
            return
        free_batch_and_context(self)
        if getattr(self, "_model", None):
            _ll.llama_model_free(self._model)
            self._model = None
            self._release_rpc()

    def _release_rpc(self) -> None:
        for ep in getattr(self, "rpc_servers", ()):
            if ep in aborts.rpc_in_use:
                aborts.rpc_in_use.remove(ep)

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def free_batch_and_context(owner) -> None:
    """Free `owner._batch` (a llama_batch) and `owner._ctx` (a llama_context) once each; a second call is a no-op."""
    if getattr(owner, "_batch", None) is not None:
        _ll.llama_batch_free(owner._batch)
        owner._batch = None
    if getattr(owner, "_ctx", None):
        _ll.llama_free(owner._ctx)
        owner._ctx = None
