"""Several sequences in one context: a second llama.cpp context on a loaded Model's weights with `n_seq` slots
(seq_id 0..n_seq-1), n_seq * n_ctx KV cells (one stream of n_ctx per sequence, or one unified cache), so every
slot can grow to the model's n_ctx, and one `llama_decode` over rows of several sequences (what llama-server's
continuous batching does).

The Model's own context (sequence 0, the single-sequence path) is untouched: this context shares only the
weights. Same settings as Model's context (flash attention, the same KV type, threads).

Rollback per sequence, by the model's kind (llama/model.py's module docstring has the single-sequence rules):
- "kv": `llama_memory_seq_rm(mem, seq, p0, -1)`.
- "rs" (the context keeps n_rs_seq recurrent-state planes): llama.cpp keeps them per sequence (one recurrent cell
  per sequence, a rollback index per sequence), so dropping 1..min(n_rs_seq, rows - 1) tail tokens of the
  sequence's rows in the LAST decode selects a plane, as on the single path, once per decode. Only where the
  sequence ran in the decode's last forward pass: a later pass of the same decode gathers its sequences' cells
  and writes their planes, which can land on the cell another sequence's planes were in. Everything else takes
  the checkpoint path.
- "checkpoint": each sequence's recurrent state is saved (`llama_state_seq_get_data_ext(..., seq,
  PARTIAL_ONLY)`, one buffer per sequence) before a decode gives it more than one row; a rollback restores it
  (`set_data_ext` on that seq id), removes that sequence's attention cells from there, and the accepted tokens
  after it are decoded again: the replay. Replays are deferred: the sequence's `tokens` already say where it is,
  and the next decode (or `flush`) first decodes every pending replay, all sequences' in one llama_decode.
A "none" model (no rollback at all) is refused: it keeps the single-sequence path.

Prompt states (core/prompt_cache.py, the server's store): a transformer sequence's state is read (`state_of`) and
put back (`restore_state`) as copy_prefix copies one between slots. `cold[s]` says how much of sequence s is held
as a cold prefill in this context computes it: whole chunks of `cold_chunk` tokens from position 0, each decoded
alone in its llama_decode (no other sequence's rows beside it), or a state of such a prefix restored or copied.
Only such a prefix's state is kept, so a restored state holds the bytes the same prompt decoded alone gives.
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
from localspec.llama.seqstate import SeqStates, roll_back
from localspec.seq import common_prefix


PREFIX_COPY_MIN = 4  # prompt tokens another sequence's cache must save to be copied (take_prefix)


def split_equal(counts: Sequence[tuple[int, int]], n_ubatch: int, keep_tail: int = 0, sequential: bool = True
                ) -> list[list[tuple[int, int, int]]]:
    """The ubatches (forward passes) llama.cpp makes of one batch when every sequence has its own KV stream:
    `llama_batch_allocr::split_equal(n_ubatch, sequential=true, keep_tail)` (llama-batch.cpp) takes a run of
    CONSECUTIVE seq ids and the SAME number of rows from each (the fewest any of them has left, at most n_ubatch in
    all), again until every row is used. `counts`: (seq, rows) per sequence in the batch. Returns per ubatch its
    (seq, first row, rows) list: rows [1, 3, 1, 2] of seqs 0..3 run as 4 x 1, then seq 1 x 2, then seq 3 x 1.

    keep_tail (n_rs_seq + 1 where the context keeps recurrent-state planes): a sequence's last keep_tail rows stay
    in one ubatch, so a ubatch keeps only the leading sequences that end in it or keep at least keep_tail rows for
    later; where the first one cannot, it runs alone (to its end where that fits). Rows [1, 3, 1, 2] with planes
    run as seq 0 x 1, seq 1 x 3, seq 2 x 1, seq 3 x 2. sequential False (a hybrid model's unified KV cache): the
    sequences of a ubatch need not be consecutive."""
    left = {int(s): int(n) for s, n in counts if n > 0}
    done = dict.fromkeys(left, 0)
    out = []
    while any(left.values()):
        run: list[int] = []
        for s in sorted(left):
            if not left[s]:
                continue
            if sequential and run and s != run[-1] + 1:
                break
            run.append(s)
        r = min(min(left[s] for s in run), max(1, n_ubatch // len(run)))
        rows = dict.fromkeys(run, r)
        if keep_tail > 0:
            n_keep = 0
            while n_keep < len(run) and not (0 < left[run[n_keep]] - r < keep_tail):
                n_keep += 1
            if n_keep == 0:
                s0 = run[0]
                rows = {s0: left[s0] if left[s0] <= n_ubatch else left[s0] - keep_tail}
            run = run[:max(n_keep, 1)]
        out.append([(s, done[s], rows[s]) for s in run])
        for s in run:
            left[s] -= rows[s]
            done[s] += rows[s]
    return out


class MultiSeq:
    """`n_seq` token-tracked sequences of `model` decoded together. `tokens[s]`: the tokens sequence s holds,
    position i = tokens[s][i] (a recurrent model's pending replay included: see the module docstring). Not
    thread-safe (one caller thread, as Model)."""

    def __init__(self, model, n_seq: int, *, n_ctx: int | None = None, unified: bool = False) -> None:
        """unified: one KV cache for all sequences (a batch is one ubatch; a sequence's cells may end up out of
        position order after other sequences' rollbacks). False: one KV stream per sequence (cells stay in order,
        as in a single-sequence context; llama.cpp splits a batch into ubatches of equal rows per sequence)."""
        if n_seq < 1:
            raise UsageError(f"need at least one sequence, got {n_seq}")
        kind = model.rollback_kind
        if kind not in ("kv", "rs", "checkpoint"):
            raise UsageError(f"{model.name} keeps a recurrent state that cannot be rolled back here ({kind} "
                             "rollback): it cannot decode several sequences in one batch")
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
        if kind == "rs":
            cparams.n_rs_seq = int(model.rs_seq)  # the planes the single-sequence context has
        with lib.DeferSignals():
            self._ctx = ll.llama_init_from_model(model._model, cparams)
        if not self._ctx:
            raise ModelLoadError(f"could not create a context of {self.n_seq} x {self.n_ctx} tokens for {model.name}")
        self.n_batch = int(ll.llama_n_batch(self._ctx))
        self._mem = ll.llama_get_memory(self._ctx)
        self._batch = ll.llama_batch_init(self.n_batch, 0, 1)
        self.rs_seq = int(ll.llama_n_rs_seq(self._ctx)) if kind == "rs" and hasattr(ll, "llama_n_rs_seq") else 0
        self.rollback_kind = "checkpoint" if kind == "rs" and self.rs_seq == 0 else kind
        # a pass keeps every sequence's last n_rs_seq + 1 rows together (llama.cpp's split with planes)
        self.keep_tail = self.rs_seq + 1 if self.rs_seq > 0 else 0
        self.n_vocab = model.n_vocab
        self.tokens: list[list[int]] = [[] for _ in range(self.n_seq)]
        self.states = SeqStates(self._ctx, self.n_seq)  # recurrent: checkpoints, replays and their counters
        self.decode_s = 0.0
        self.decodes = 0
        self.last_rows: dict[int, tuple[int, int]] = {}  # seq -> (first row, rows) in the last decode's batch
        self.cold_chunk = 0  # the chunk `cold` counts in (0: not tracked)
        self.cold = [0] * self.n_seq  # per sequence: its prefix decoded as a cold prefill here (module docstring)

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def ctx_handle(self):
        """The llama_context pointer, for the reads of the last decode's hidden states (llama/taps.py)."""
        return self._ctx

    @property
    def recurrent(self) -> bool:
        return self.rollback_kind != "kv"

    def decode(self, parts: Sequence[tuple[int, Sequence[int], Sequence[int]]], copy: bool = True
               ) -> list[np.ndarray]:
        """One llama_decode over every part: (seq, tokens appended at the end of that sequence, indices into
        tokens whose logits are wanted). Returns one (rows, n_vocab) array per part. The rows together must fit
        n_batch (the caller chunks prefill). copy=False: views of llama.cpp's buffer, valid until the next decode.
        A recurrent model's pending replays are decoded first (flush), and each sequence given more than one row
        saves its state before them (what a rollback into those rows restores)."""
        total = sum(len(t) for _, t, _ in parts)
        if total == 0:
            raise ValueError("decode() needs at least one token")
        if total > self.n_batch:
            raise ValueError(f"{total} rows do not fit a batch of {self.n_batch}")
        for seq, toks, _ in parts:
            if not 0 <= seq < self.n_seq:
                raise ValueError(f"no sequence {seq}")
            if len(self.tokens[seq]) + len(toks) > self.n_ctx:
                raise DecodeError(f"{self.name}: context full ({len(self.tokens[seq])} + {len(toks)} > "
                                  f"{self.n_ctx} tokens)")
        if self.recurrent:
            self.flush()
            for seq, toks, _ in parts:
                if len(toks) > 1:
                    self.states.save(seq, len(self.tokens[seq]))
        out = self._decode(parts, copy)
        if len(parts) == 1 and self.cold_chunk and not self.recurrent:  # a chunk alone: a cold prefill's pass?
            seq, toks, _ = parts[0]
            c, at = self.cold_chunk, len(self.tokens[seq])
            if self.cold[seq] == at and at % c == 0 and len(toks) == c:
                self.cold[seq] = at + c
        for seq, toks, _ in parts:
            self.tokens[seq].extend(int(t) for t in toks)
        return out

    def _decode(self, parts, copy: bool) -> list[np.ndarray]:
        """The llama_decode of `parts` at each sequence's decoded length (states.done; tokens are the caller's)."""
        # rows in increasing seq order: with one stream per sequence llama.cpp puts only consecutive seq ids
        # in one ubatch, in the order the batch gives them
        order = sorted(range(len(parts)), key=lambda j: parts[j][0])
        b = self._batch
        i = 0
        n_out = [0] * len(parts)
        done = self.states.done
        spans = {}
        for j in order:
            seq, toks, rows = parts[j]
            spans[seq] = (i, len(toks)) if seq not in spans else None  # twice: not one run of rows
            base = done[seq] if self.recurrent else len(self.tokens[seq])
            want = set(rows)
            for k, t in enumerate(toks):
                b.token[i] = int(t)
                b.pos[i] = base + k
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
                b.logits[i] = k in want
                i += 1
            n_out[j] = len(want)
        b.n_tokens = i
        self.last_rows = {}
        t0 = time.perf_counter()
        rc = _ll.llama_decode(self._ctx, b)
        self.decode_s += time.perf_counter() - t0
        self.decodes += 1
        if rc != 0:
            raise DecodeError(f"{self.name}: llama_decode failed (code {rc})")
        self.last_rows = {seq: span for seq, span in spans.items() if span is not None}
        if self.recurrent:
            counts = [(seq, len(toks)) for seq, toks, _ in parts]
            self.states.decoded(counts, {s for s, _, _ in self.passes(counts)[-1]})
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

    def flush(self) -> int:
        """Decode every sequence's pending replay (the accepted tokens after a restored checkpoint), all sequences'
        in one llama_decode where they fit n_batch. Returns the tokens replayed."""
        if not self.recurrent:
            return 0
        lag = {s: self.tokens[s][self.states.done[s]:] for s in range(self.n_seq)
               if self.states.done[s] < len(self.tokens[s])}
        total = 0
        while lag:
            budget, parts = self.n_batch, []
            for s in sorted(lag):
                n = min(len(lag[s]), budget)
                if n <= 0:
                    break
                parts.append((s, lag[s][:n], ()))
                budget -= n
            self._decode(parts, copy=False)
            for s, toks, _ in parts:
                self.states.replayed[s] += len(toks)
                total += len(toks)
                lag[s] = lag[s][len(toks):]
                if not lag[s]:
                    del lag[s]
        return total

    def pending(self, seq: int) -> int:
        """Tokens of sequence `seq` waiting to be replayed (flush)."""
        return len(self.tokens[seq]) - self.states.done[seq] if self.recurrent else 0

    def passes(self, counts: Sequence[tuple[int, int]]) -> list[list[tuple[int, int, int]]]:
        """The forward passes one decode() of (seq, rows) counts runs as (see split_equal); one unified KV cache
        takes the whole batch in one pass (n_ubatch = n_batch). A recurrent/hybrid model's batch is always split in
        equal rows per sequence (its recurrent cells take one state per sequence), each sequence's last planes'
        rows together; in consecutive sequences, but for a hybrid's unified attention cache."""
        if not self.recurrent:
            if self.unified:
                return [[(int(s), 0, int(n)) for s, n in sorted(counts) if n > 0]]
            return split_equal(counts, self.n_batch)
        hybrid = bool(getattr(self.model, "is_hybrid", False))
        return split_equal(counts, self.n_batch, self.keep_tail, sequential=not (self.unified and hybrid))

    def truncate(self, seq: int, n_keep: int) -> None:
        """Remove sequence `seq`'s cache entries from position n_keep on. A recurrent model selects a plane, or
        restores the sequence's checkpoint and leaves the tokens after it to replay (flush)."""
        n_keep = max(int(n_keep), 0)
        if n_keep >= len(self.tokens[seq]):
            return
        if n_keep == 0:
            self.clear(seq)
            return
        self.cold[seq] = min(self.cold[seq], n_keep)
        if self.recurrent and n_keep >= self.states.done[seq]:  # inside a pending replay: it just gets shorter
            del self.tokens[seq][n_keep:]
            return
        roll_back(self.states, self._mem, seq, n_keep, self.rollback_kind, self.rs_seq, self.name)
        del self.tokens[seq][n_keep:]

    def reachable(self, seq: int, n: int) -> int:
        """The longest prefix of at most `n` cached tokens sequence `seq` can be cut to without a replay: n itself
        for a transformer; for a recurrent model n where nothing is cut (of what is really decoded) or a plane can
        be selected, else its checkpoint's position (0 without one). The caller decodes the rest as new rows (a
        prompt beside the others' steps) instead of a replay decode of its own."""
        n = max(0, min(int(n), len(self.tokens[seq])))
        if not self.recurrent:
            return n
        st = self.states
        if n >= st.done[seq]:  # at most what is really decoded: a pending replay's tokens are decoded as new ones
            return st.done[seq]
        if self.rollback_kind == "rs" and st.can_select(seq, st.done[seq] - n, self.rs_seq):
            return n
        pos = st.pos[seq]
        return pos if pos is not None and pos <= n else 0

    def rollback_counters(self, seq: int) -> dict:
        """What sequence `seq`'s rollbacks cost so far (Model.rollback_counters' fields; take differences)."""
        return self.states.counters(seq)

    def save_checkpoint(self, seq: int) -> None:
        """Save sequence `seq`'s recurrent state at its current length (a no-op for a transformer): what a caller
        about to make several one-row decodes it may roll back (a draft model's rounds) calls first."""
        if self.recurrent:
            self.flush()
            self.states.save(seq, len(self.tokens[seq]))

    def take_prefix(self, seq: int, tokens: Sequence[int], min_gain: int = PREFIX_COPY_MIN) -> int:
        """How many of `tokens` sequence `seq` starts with cached: its own common prefix with them, or a longer one
        copied from another sequence's cache (copy_prefix) where that saves at least `min_gain` tokens. Chat
        requests share the template's system prompt, so a new conversation in another slot decodes only its own
        part, as llama-server's prompt cache does across slots. A recurrent model keeps only what it can reach
        without a replay (reachable): another sequence's state is that of its whole cache, never of a prefix."""
        own = best = common_prefix(self.tokens[seq], tokens)
        if self.recurrent:
            return self.reachable(seq, own)
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
        tokens dst now holds (0 when llama.cpp could not restore the copy; dst is then empty). Transformers only
        (take_prefix does not copy a recurrent state)."""
        n = max(0, min(int(n), len(self.tokens[src])))
        if src == dst:
            self.truncate(dst, n)
            return len(self.tokens[dst])
        if self.recurrent:
            raise UsageError(f"{self.name} keeps a recurrent state: one sequence's prefix cannot be copied to another")
        self.clear(dst)
        if n == 0:
            return 0
        if self.unified:
            _ll.llama_memory_seq_cp(self._mem, src, dst, 0, n)
        else:
            data = self.state_of(src)
            if not data or not self._set_state(dst, data, len(self.tokens[src])):
                self.clear(dst)
                return 0
            self.tokens[dst] = list(self.tokens[src])
            self.cold[dst] = self.cold[src]
            self.truncate(dst, n)
            return n
        self.tokens[dst] = list(self.tokens[src][:n])
        self.cold[dst] = min(self.cold[src], n)
        return n

    def state_of(self, seq: int) -> bytes:
        """Sequence `seq`'s state for the tokens it holds, as llama.cpp serializes it (llama_state_seq_get_data):
        what restore_state() puts back into a sequence of a context with the same settings. b"" for an empty or
        recurrent sequence (a recurrent state is that of the whole text: not kept this way)."""
        if self.recurrent or not self.tokens[seq]:
            return b""
        size = int(_ll.llama_state_seq_get_size(self._ctx, seq))
        if size <= 0:
            return b""
        buf = (ctypes.c_uint8 * size)()
        got = int(_ll.llama_state_seq_get_data(self._ctx, buf, size, seq))
        return ctypes.string_at(buf, got) if got > 0 else b""

    def _set_state(self, seq: int, data: bytes, n: int) -> bool:
        """Load `data` (state_of) into the emptied sequence `seq`; whether llama.cpp took it and it holds positions
        0..n-1."""
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return (int(_ll.llama_state_seq_set_data(self._ctx, buf, len(data), seq)) > 0
                and int(_ll.llama_memory_seq_pos_min(self._mem, seq)) == 0
                and int(_ll.llama_memory_seq_pos_max(self._mem, seq)) == n - 1)

    def restore_state(self, seq: int, tokens: Sequence[int], data: bytes, cold: bool = False) -> bool:
        """Replace sequence `seq`'s cache with a state_of() state of `tokens`. False, with the sequence empty, where
        llama.cpp refuses the bytes (another KV type or layer count, more cells than a sequence has) or they hold
        another number of tokens; a recurrent model is refused without a try. No logits: the caller decodes at least
        the next token. `cold`: the state is of a prefix decoded as a cold prefill here (whole cold_chunk chunks)."""
        tokens = [int(t) for t in tokens]
        self.clear(seq)
        if self.recurrent or not tokens or not data or len(tokens) > self.n_ctx:
            return False
        if not self._set_state(seq, data, len(tokens)):
            self.clear(seq)
            return False
        self.tokens[seq] = tokens
        c = self.cold_chunk
        self.cold[seq] = len(tokens) if cold and c and len(tokens) % c == 0 else 0
        return True

    def clear(self, seq: int | None = None) -> None:
        """Empty one sequence (None: all of them)."""
        if seq is None:
            _ll.llama_memory_clear(self._mem, True)
            for s, t in enumerate(self.tokens):
                t.clear()
                self.states.cleared(s)
                self.cold[s] = 0
            return
        _ll.llama_memory_seq_rm(self._mem, seq, -1, -1)
        self.tokens[seq].clear()
        self.cold[seq] = 0
        self.states.cleared(seq)

    def close(self) -> None:
        if _ll is None:
            return
        free_batch_and_context(self)

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass
