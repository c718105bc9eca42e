"""Prompt states across processes for a request decoded alone (`run`, `chat`: core/batch.py on the target's own context, Engine.prefill): the
state of a prompt's prefix restored from the store (store/prompt_states.py) before its prefill, so a new process
asked about the same piped file decodes only the rest, and the state of its prefix saved during the prefill.

Same answers by construction. A cold prefill (Model.sync from an empty cache) decodes the prompt in chunks of the
target's n_batch from position 0, and llama.cpp's KV rows depend on the pass they were computed in (on CPUs that
repack quantized weights a row rounds by the rows of its pass; attention sums over the cells the pass spans). So a
state is saved only for a prefix of a multiple of n_batch tokens that the cache holds as whole chunks decoded from
position 0 (Model.cold_upto), and restored only there (the store keys states by n_batch): the rest of the prompt is
then decoded in exactly the chunks a cold prefill of it makes, and the cache holds the same bytes a cold prefill
leaves. The prefill is split at the last multiple of n_batch before the prompt's last token (`save_point`): the cache
filled to there, its state saved, then the rest decoded, the pass a cold prefill ends with.

Not kept: a cache that holds an answer (decoded a token or a verify at a time, not as a cold prefill would), and the
states of recurrent and hybrid models (rollback kind other than "kv": their state is that of the whole text).
A draft model of the target's vocabulary keeps its state beside the target's under its own key: its cache changes
which drafts it proposes, never which tokens are emitted, and it is restored and saved as the target's is.

`localspec serve` keeps its states in a `ServerStates`: an LRU in memory for the server's lifetime (MemoryStates,
--prompt-cache-ram) over the disk store, so a hit in memory costs no read and a restarted server restores from
disk. Its batch (core/batch.py, --parallel N) keeps the states of its slots beside the single-sequence ones under
their own key (`batch_key`): the batch decodes a prompt in chunks of its own size (prefill_chunk, 256) in another
context (llama/multiseq.py), so its states are not a single-sequence prefill's bytes and never restored there, nor
these here. A slot's state is kept only for a prefix the slot decoded as a cold prefill in the batch decodes it
(whole chunks from position 0, each alone in its llama_decode: MultiSeq.cold), at `chunk_save_point`.
"""

from __future__ import annotations

import time
from typing import Sequence

from localspec.seq import common_prefix
from localspec.store.prompt_states import MemoryStates, PromptStates, aligned, state_key


def usable(model) -> bool:
    """A model whose states are kept: a plain transformer (rollback kind "kv") of llama/model.py."""
    return model is not None and model.rollback_kind == "kv" and hasattr(model, "state_bytes")


def save_point(model, n_prompt: int) -> int:
    """Where a prompt of n_prompt tokens saves its prefix's state: the last multiple of the model's n_batch before the
    prompt's last token (which is decoded for its logits), where the store keeps one (block-aligned, long enough);
    0 where there is none."""
    nb = int(model.n_batch)
    a = (int(n_prompt) - 1) // nb * nb if nb > 0 else 0
    return a if a > 0 and aligned(a) == a else 0


def chunk_save_point(chunk: int, n_prompt: int) -> int:
    """save_point for a prompt decoded in chunks of `chunk` tokens (the batch's): the last multiple of it before the
    prompt's last token, where the store keeps one; 0 where there is none."""
    c = int(chunk)
    a = (int(n_prompt) - 1) // c * c if c > 0 else 0
    return a if a > 0 and aligned(a) == a else 0


def batch_key(model, chunk: int, unified: bool) -> str:
    """The key of a batch's slot states (core/batch.py): the target's state_key and what else changes a slot's
    bytes or their layout: the batch's chunk, its KV layout (one cache for all slots or a stream each)."""
    return f"{state_key(model)}|batch|chunk={int(chunk)}|unified={bool(unified)}"


class ServerStates:
    """A server's store of prompt states: `memory` (a MemoryStates of `memory_budget` bytes, none at 0) over
    `disk` (a PromptStates, or None). The interface of PromptStates (longest, has, put), and `find`, which says
    where a state came from."""

    def __init__(self, memory_budget: int, disk: PromptStates | None = None) -> None:
        self.memory = MemoryStates(memory_budget) if memory_budget > 0 else None
        self.disk = disk
        self.last_source = ""  # where the last longest()/find() hit came from: "memory" | "disk" | ""

    def find(self, key: str, tokens: Sequence[int], longer_than: int = 0) -> tuple[int, bytes, str] | None:
        """(n, state, "memory" or "disk") of the longest stored prefix tokens[:n], n > longer_than; a state read
        from disk is kept in memory too."""
        tokens = list(tokens)
        hit = self.memory.longest(key, tokens, longer_than) if self.memory is not None else None
        if self.disk is not None:
            deeper = self.disk.longest(key, tokens, max(longer_than, hit[0] if hit else 0))
            if deeper is not None:
                if self.memory is not None:
                    self.memory.put(key, tokens[:deeper[0]], deeper[1])
                return deeper[0], deeper[1], "disk"
        return (hit[0], hit[1], "memory") if hit else None

    def longest(self, key: str, tokens: Sequence[int], longer_than: int = 0) -> tuple[int, bytes] | None:
        found = self.find(key, tokens, longer_than)
        self.last_source = found[2] if found else ""
        return found[:2] if found else None

    def has(self, key: str, tokens: Sequence[int]) -> bool:
        """Whether the state of exactly `tokens` is kept: in memory (marked recently used) or on disk."""
        tokens = list(tokens)
        if self.memory is not None and tokens and self.memory.longest(key, tokens, len(tokens) - 1) is not None:
            return True
        return self.disk is not None and self.disk.has(key, tokens)

    def put(self, key: str, tokens: Sequence[int], data: bytes, label: str = "") -> bool:
        kept = self.memory.put(key, tokens, data, label) if self.memory is not None else False
        return (self.disk.put(key, tokens, data, label) if self.disk is not None else False) or kept

    def summary(self) -> dict:
        out = self.disk.summary() if self.disk is not None else {}
        if self.memory is not None:
            out["memory"] = self.memory.summary()["memory"]
        return out

    def clear(self) -> int:
        return sum(x.clear() for x in (self.memory, self.disk) if x is not None)


def find(store, key: str, tokens: Sequence[int], longer_than: int = 0) -> tuple[int, bytes, str] | None:
    """(n, state, where from) of the longest stored prefix in any store: a ServerStates says; a MemoryStates'
    hits count as memory, a PromptStates' as disk."""
    if isinstance(store, ServerStates):
        return store.find(key, tokens, longer_than)
    hit = store.longest(key, tokens, longer_than)
    return (hit[0], hit[1], "memory" if isinstance(store, MemoryStates) else "disk") if hit else None


def has(store, key: str, tokens: Sequence[int]) -> bool:
    """Whether `store` keeps the state of exactly `tokens` (a MemoryStates has no has(): its longest, at that
    length only)."""
    if hasattr(store, "has"):
        return store.has(key, tokens)
    tokens = list(tokens)
    return bool(tokens) and store.longest(key, tokens, len(tokens) - 1) is not None


class PromptCache:
    """The store of prompt states as a request's prefill uses it. `store`: a PromptStates (or MemoryStates)."""

    def __init__(self, store) -> None:
        self.store = store
        self.restore_s = 0.0  # time spent reading and restoring states, and saving them
        self.save_s = 0.0
        self.saved_bytes = 0

    def restore(self, model, prompt: Sequence[int]) -> int:
        """Restore the longest stored prefix of `prompt` (never all of it: its last token is decoded for logits) that
        is longer than what the model's cache already shares with it. Returns the tokens restored (0: none, the cache
        as it was)."""
        if not usable(model) or len(prompt) < 2:
            return 0
        prompt = [int(t) for t in prompt]
        have = min(common_prefix(model.tokens, prompt), len(prompt) - 1)
        t0 = time.perf_counter()
        try:
            key = state_key(model)
            hit = self.store.longest(key, prompt[:-1], longer_than=have)
            if hit is None:
                return 0
            n, data = hit
            # a state of another n_batch is under another key: never here, but it would not be a cold prefix
            if n % int(model.n_batch) or not model.restore_state(prompt[:n], data, cold=True):
                return 0
            return n
        except OSError:
            return 0
        finally:
            self.restore_s += time.perf_counter() - t0

    def save_prefix(self, model, prompt: Sequence[int]) -> int:
        """Fill the model's cache to the prompt's save point and save the state there, where that prefix is held as
        a cold prefill computes it and the store has no state of it yet. Returns the save point when the cache was
        filled to it (the caller decodes the rest), else 0 (nothing decoded)."""
        if not usable(model):
            return 0
        prompt = [int(t) for t in prompt]
        a = save_point(model, len(prompt))
        if not a:
            return 0
        have = min(common_prefix(model.tokens, prompt), len(prompt) - 1)
        # the cache must reach `a` as whole chunks from 0: what it holds of the prompt is cold and ends at a chunk
        # boundary at or before `a` (past `a`, the state would cover more than the prefix)
        if have > a or have % int(model.n_batch) or model.cold_upto < have:
            return 0
        key = state_key(model)
        if has(self.store, key, prompt[:a]):
            return 0
        model.fill(prompt[:a])
        if model.cold_upto != a or len(model.tokens) != a:
            return a  # filled, but not as a cold prefill (cannot happen from the checks above): nothing saved
        t0 = time.perf_counter()
        data = model.state_bytes()
        if data and self.store.put(key, prompt[:a], data, label=model.name):
            self.saved_bytes += len(data)
        self.save_s += time.perf_counter() - t0
        return a

    def save_draft(self, model, prompt: Sequence[int], fill: bool = False) -> None:
        """The draft model's state at the prompt's save point, where the store has none: its cache cut back to there
        when it holds more of the prompt (after a request), or filled to there where `fill` (a reopened chat's
        prefill: the catch-up its first proposal would make, made now). A draft's cache need not be a cold prefill's
        (it changes which drafts are proposed, not the emitted tokens), so what it holds is kept as it is."""
        if not usable(model):
            return
        prompt = [int(t) for t in prompt]
        a = save_point(model, len(prompt))
        if not a:
            return
        common = common_prefix(model.tokens, prompt)
        if common < a and not fill:
            return  # it never caught up with the prefix: not decoded for the store's sake
        key = state_key(model)
        if has(self.store, key, prompt[:a]):
            return
        if common > a:
            model.truncate(a)
        else:
            model.fill(prompt[:a])
        t0 = time.perf_counter()
        data = model.state_bytes()
        if data and self.store.put(key, prompt[:a], data, label=model.name):
            self.saved_bytes += len(data)
        self.save_s += time.perf_counter() - t0

    def restore_draft(self, model, prompt: Sequence[int]) -> int:
        """The draft model's longest stored prefix of the prompt, where longer than what its cache shares with it."""
        if not usable(model) or len(prompt) < 2:
            return 0
        prompt = [int(t) for t in prompt]
        have = common_prefix(model.tokens, prompt)
        t0 = time.perf_counter()
        try:
            hit = self.store.longest(state_key(model), prompt[:-1], longer_than=have)
            if hit is None:
                return 0
            n, data = hit
            return n if model.restore_state(prompt[:n], data) else 0
        except OSError:
            return 0
        finally:
            self.restore_s += time.perf_counter() - t0
