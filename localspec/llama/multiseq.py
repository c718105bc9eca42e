"""Several sequences in one context: a second llama.cpp context on a loaded Model's weights with `n_seq` slots
(seq_id 0..n_seq-1), n_seq * n_ctx KV cells (one stream of n_ctx per sequence, or one unified cache), so every
slot can grow to the model's n_ctx, and one `llama_decode` over rows of several sequences (what llama-server's
continuous batching does).

The Model's own context (sequence 0, the single-sequence path) is untouched: this context shares only the
weights. Same settings as Model's context (flash attention, the same KV type, threads). Rollback is
`llama_memory_seq_rm(mem, seq, p0, -1)`: transformers only (Model.rollback_kind "kv"); recurrent/hybrid targets
keep the single-sequence path.
"""

from __future__ import annotations

import ctypes
import time
from typing import Sequence

import numpy as np

from localspec.errors import DecodeError, ModelLoadError, UsageError
from localspec.llama import lib
from localspec.llama.lib import ll as _ll
from localspec.llama.model import GGML_TYPES, free_batch_and_context
from localspec.seq import common_prefix


PREFIX_COPY_MIN = 4  # prompt tokens another sequence's cache must save to be copied (take_prefix)


def split_equal(counts: Sequence[tuple[int, int]], n_ubatch: int) -> list[list[tuple[int, int, int]]]:
    """The ubatches (forward passes) llama.cpp makes of one batch when every sequence has its own KV stream:
    `llama_batch_allocr::split_equal(n_ubatch, sequential=true)` (llama-batch.cpp) takes a run of CONSECUTIVE seq
    ids and the SAME number of rows from each (the fewest any of them has left, at most n_ubatch in all), again
    until every row is used. `counts`: (seq, rows) per sequence in the batch. Returns per ubatch its
    (seq, first row, rows) list: rows [1, 3, 1, 2] of seqs 0..3 run as 4 x 1, then seq 1 x 2, then seq 3 x 1."""
    left = {int(s): int(n) for s, n in counts if n > 0}
    done = dict.fromkeys(left, 0)
    out = []
    while any(left.values()):
        run: list[int] = []
        for s in sorted(left):
            if not left[s]:
                continue
            if run and s != run[-1] + 1:
                break
            run.append(s)
        r = min(min(left[s] for s in run), max(1, n_ubatch // len(run)))
        out.append([(s, done[s], r) for s in run])
        for s in run:
            left[s] -= r
            done[s] += r
    return out


class MultiSeq:
    """`n_seq` token-tracked sequences of `model` decoded together. `tokens[s]`: the tokens whose KV is cached
    for sequence s, position i = tokens[s][i]. Not thread-safe (one caller thread, as Model)."""

    def __init__(self, model, n_seq: int, *, n_ctx: int | None = None, unified: bool = False) -> None:
        """unified: one KV cache for all sequences (a batch is one ubatch; a sequence's cells may end up out of
        position order after other sequences' rollbacks). False: one KV stream per sequence (cells stay in order,
        as in a single-sequence context; llama.cpp splits a batch into ubatches of equal rows per sequence)."""
        if n_seq < 1:
            raise UsageError(f"need at least one sequence, got {n_seq}")
        if getattr(model, "rollback_kind", "kv") != "kv":
            raise UsageError(f"{model.name} keeps a recurrent state ({model.rollback_kind} rollback): it cannot "
                             "decode several sequences in one batch here")
        ll = lib.require()
        self.model = model
        self.n_seq = int(n_seq)
        self.n_ctx = int(n_ctx or model.n_ctx)  # per sequence
        self._ctx = self._batch = None
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = self.n_ctx * self.n_seq
        cparams.n_batch = cparams.n_ubatch = model.n_batch
        cparams.n_seq_max = self.n_seq
        cparams.kv_unified = bool(unified)
        self.unified = bool(unified)
        cparams.n_threads = cparams.n_threads_batch = model.n_threads
        cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cparams.type_k = cparams.type_v = GGML_TYPES[model.kv_type]
        cparams.no_perf = True
        with lib.DeferSignals():
            self._ctx = ll.llama_init_from_model(model._model, cparams)
        if not self._ctx:
            raise ModelLoadError(f"could not create a context of {self.n_seq} x {self.n_ctx} tokens for {model.name}")
        self.n_batch = int(ll.llama_n_batch(self._ctx))
        self._mem = ll.llama_get_memory(self._ctx)
        self._batch = ll.llama_batch_init(self.n_batch, 0, 1)
        self.n_vocab = model.n_vocab
        self.tokens: list[list[int]] = [[] for _ in range(self.n_seq)]
        self.decode_s = 0.0
        self.decodes = 0
        self.last_rows: dict[int, tuple[int, int]] = {}  # seq -> (first row, rows) in the last decode's batch

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def ctx_handle(self):
        """The llama_context pointer, for the reads of the last decode's hidden states (llama/taps.py)."""
        return self._ctx

    def decode(self, parts: Sequence[tuple[int, Sequence[int], Sequence[int]]], copy: bool = True
               ) -> list[np.ndarray]:
        """One llama_decode over every part: (seq, tokens appended at the end of that sequence, indices into
        tokens whose logits are wanted). Returns one (rows, n_vocab) array per part. The rows together must fit
        n_batch (the caller chunks prefill). copy=False: views of llama.cpp's buffer, valid until the next decode."""
        total = sum(len(t) for _, t, _ in parts)
        if total == 0:
            raise ValueError("decode() needs at least one token")
        if total > self.n_batch:
            raise ValueError(f"{total} rows do not fit a batch of {self.n_batch}")
        # rows in increasing seq order: with one stream per sequence llama.cpp puts only consecutive seq ids
        # in one ubatch, in the order the batch gives them
        order = sorted(range(len(parts)), key=lambda j: parts[j][0])
        b = self._batch
        i = 0
        n_out = [0] * len(parts)
        spans = {}
        for j in order:
            seq, toks, rows = parts[j]
            if not 0 <= seq < self.n_seq:
                raise ValueError(f"no sequence {seq}")
            spans[seq] = (i, len(toks)) if seq not in spans else None  # twice: not one run of rows
            base = len(self.tokens[seq])
            if base + len(toks) > self.n_ctx:
                raise DecodeError(f"{self.name}: context full ({base} + {len(toks)} > {self.n_ctx} tokens)")
            want = set(rows)
            for k, t in enumerate(toks):
                b.token[i] = int(t)
                b.pos[i] = base + k
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
                b.logits[i] = k in want
                i += 1
            n_out[j] = len(want)
        b.n_tokens = total
        self.last_rows = {}
        t0 = time.perf_counter()
        rc = _ll.llama_decode(self._ctx, b)
        self.decode_s += time.perf_counter() - t0
        self.decodes += 1
        if rc != 0:
            raise DecodeError(f"{self.name}: llama_decode failed (code {rc})")
        for seq, toks, _ in parts:
            self.tokens[seq].extend(int(t) for t in toks)
        self.last_rows = {seq: span for seq, span in spans.items() if span is not None}
        n_all = sum(n_out)
        arr = None
        if n_all:
            ptr = _ll.llama_get_logits(self._ctx)
            arr = np.ctypeslib.as_array(ptr, shape=(n_all, self.n_vocab))
        out: list = [None] * len(parts)
        start = 0
        for j in order:
            n = n_out[j]
            if n == 0:
                out[j] = np.empty((0, self.n_vocab), dtype=np.float32)
                continue
            view = arr[start:start + n]
            out[j] = np.array(view, copy=True) if copy else view
            start += n
        return out

    def passes(self, counts: Sequence[tuple[int, int]]) -> list[list[tuple[int, int, int]]]:
        """The forward passes one decode() of (seq, rows) counts runs as (see split_equal); one unified KV cache
        takes the whole batch in one pass (n_ubatch = n_batch)."""
        if self.unified:
            return [[(int(s), 0, int(n)) for s, n in sorted(counts) if n > 0]]
        return split_equal(counts, self.n_batch)

    def truncate(self, seq: int, n_keep: int) -> None:
        """Remove sequence `seq`'s cache entries from position n_keep on."""
        n_keep = max(int(n_keep), 0)
        if n_keep >= len(self.tokens[seq]):
            return
        if not _ll.llama_memory_seq_rm(self._mem, seq, n_keep, -1):
            raise DecodeError(f"{self.name}: llama.cpp cannot remove KV entries of sequence {seq} from {n_keep}")
        del self.tokens[seq][n_keep:]

    def take_prefix(self, seq: int, tokens: Sequence[int], min_gain: int = PREFIX_COPY_MIN) -> int:
        """How many of `tokens` sequence `seq` starts with cached: its own common prefix with them, or a longer one
        copied from another sequence's cache (copy_prefix) where that saves at least `min_gain` tokens. Chat
        requests share the template's system prompt, so a new conversation in another slot decodes only its own
        part, as llama-server's prompt cache does across slots."""
        own = best = common_prefix(self.tokens[seq], tokens)
        min_gain = max(1, int(min_gain))
        if own + min_gain > len(tokens):
            return own  # no other cache can save min_gain more (a running sequence's step: only its new tokens)
        src = None
        for s in range(self.n_seq):
            if s != seq:
                c = common_prefix(self.tokens[s], tokens)
                if c > best:
                    best, src = c, s
        if src is None or best - own < min_gain:
            return own
        return self.copy_prefix(src, seq, best)

    def copy_prefix(self, src: int, dst: int, n: int) -> int:
        """Make sequence `dst` hold the first `n` cached tokens of sequence `src` (dst's own cache is dropped), so a
        prompt that shares a prefix with another slot's cache (the chat template's system prompt) decodes only the
        rest. One unified cache: the cells are shared (`llama_memory_seq_cp`, no data copied). Separate streams:
        src's sequence state is copied into dst's stream (`llama_state_seq_get_data` / `set_data`, what
        llama-server's prompt cache does) and cut at n. The copied K/V are the same bytes src decoded. Returns the
        tokens dst now holds (0 when llama.cpp could not restore the copy; dst is then empty)."""
        n = max(0, min(int(n), len(self.tokens[src])))
        if src == dst:
            self.truncate(dst, n)
            return len(self.tokens[dst])
        self.clear(dst)
        if n == 0:
            return 0
        if self.unified:
            _ll.llama_memory_seq_cp(self._mem, src, dst, 0, n)
        else:
            size = int(_ll.llama_state_seq_get_size(self._ctx, src))
            buf = (ctypes.c_uint8 * size)()
            got = int(_ll.llama_state_seq_get_data(self._ctx, buf, size, src))
            if not got or not int(_ll.llama_state_seq_set_data(self._ctx, buf, got, dst)):
                self.clear(dst)
                return 0
            self.tokens[dst] = list(self.tokens[src])
            self.truncate(dst, n)
            return n
        self.tokens[dst] = list(self.tokens[src][:n])
        return n

    def clear(self, seq: int | None = None) -> None:
        """Empty one sequence (None: all of them)."""
        if seq is None:
            _ll.llama_memory_clear(self._mem, True)
            for t in self.tokens:
                t.clear()
            return
        _ll.llama_memory_seq_rm(self._mem, seq, -1, -1)
        self.tokens[seq].clear()

    def close(self) -> None:
        if _ll is None:
            return
        free_batch_and_context(self)

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass
