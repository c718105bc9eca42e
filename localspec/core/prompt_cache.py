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

A request may name where the part of its prompt that later prompts share ends (GenConfig.shared_upto: `run`'s
piped text, which the next question about the same file repeats): its prefill then also splits there (`shared_mark`,
cut to a length the store keeps), with or without a store, so its cold prefill is whole chunks from 0 to the last
multiple of n_batch before the mark, one chunk to the mark, then chunks from the mark. The state at the mark is kept,
and restored only by a prompt with the same mark (a state at a length that is not a multiple of n_batch is of that
split only); states at multiples of n_batch up to the mark stay shared with every prompt. The next question about the
file then decodes only itself, not up to n_batch - 1 tokens of the file's end again.

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


def shared_mark(upto: int, n_prompt: int) -> int:
    """The split a request asks for (GenConfig.shared_upto: where the part of its prompt that later prompts share ends,
    e.g. the piped text of `run`), as the prefill makes it: cut to a length the store keeps (block-aligned, long
    enough), before the prompt's last token; 0 for none."""
    return aligned(min(int(upto), int(n_prompt) - 1)) if upto and upto > 0 else 0


def save_point(model, n_prompt: int, mark: int = 0) -> int:
    """Where a prompt of n_prompt tokens saves its prefix's state: its mark (shared_mark) where it has one, else the
    last multiple of the model's n_batch before the prompt's last token (which is decoded for its logits), where the
    store keeps one (block-aligned, long enough); 0 where there is none."""
    if mark:
        return mark
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

    def restore(self, model, prompt: Sequence[int], mark: int = 0) -> int:
        """Restore the longest stored prefix of `prompt` (never all of it: its last token is decoded for logits) that
        is longer than what the model's cache already shares with it, at a length its cold prefill stops at: a
        multiple of n_batch, and with a mark (shared_mark) only up to the mark, the mark included. Returns the tokens
        restored (0: none, the cache as it was)."""
        if not usable(model) or len(prompt) < 2:
            return 0
        prompt = [int(t) for t in prompt]
        have = min(common_prefix(model.tokens, prompt), len(prompt) - 1)
        t0 = time.perf_counter()
        try:
            key = state_key(model)
            nb = int(model.n_batch)
            top = mark if mark else len(prompt) - 1
            # the lengths a cold prefill of this prompt stops at, longest first (a state at another prompt's mark is
            # of another split, never restored here); looked up by name before any state is read
            ends = sorted({mark, *range(top // nb * nb, 0, -nb)} - {0}, reverse=True)
            for n in ends:
                if n <= have:
                    break
                if not has(self.store, key, prompt[:n]):
                    continue
                hit = self.store.longest(key, prompt[:n], longer_than=n - 1)
                if hit is not None and model.restore_state(prompt[:n], hit[1], cold=n % nb == 0):
                    return n
            return 0
        except OSError:
            return 0
        finally:
            self.restore_s += time.perf_counter() - t0

    def _put(self, model, key: str, tokens: Sequence[int]) -> bool:
        """The state of what the model's cache holds (exactly `tokens`) into the store; whether it was kept."""
        t0 = time.perf_counter()
        data = model.state_bytes()
        kept = bool(data) and self.store.put(key, tokens, data, label=model.name)
        if kept:
            self.saved_bytes += len(data)
        self.save_s += time.perf_counter() - t0
        return kept

    def keep_leaving(self, model, prompt: Sequence[int]) -> int:
        """Before `prompt` replaces what the model's cache holds: the state of the cache's cold prefix (whole n_batch
        chunks from 0, Model.cold_upto) where the new prompt does not keep it and the store has none, so a prefill
        cut short (a client that gave up and will retry) or a prompt pushed out by another request's is restored
        later instead of decoded again. Returns the tokens kept (0: none)."""
        if not usable(model):
            return 0
        c = int(model.cold_upto)
        if c <= 0 or aligned(c) != c or c % int(model.n_batch) or common_prefix(model.tokens, prompt) >= c:
            return 0
        key, tokens = state_key(model), [int(t) for t in model.tokens[:c]]
        if has(self.store, key, tokens):
            return 0
        if len(model.tokens) > c:
            model.truncate(c)  # the new prompt shares less than c with it: this part goes anyway
        return c if self._put(model, key, tokens) else 0

    def save_prefix(self, model, prompt: Sequence[int], mark: int = 0) -> int:
        """Fill the model's cache to the prompt's save point and save the state there, where that prefix is held as
        a cold prefill computes it and the store has no state of it yet. Returns the save point when the cache was
        filled to it (the caller decodes the rest), else 0 (nothing decoded)."""
        if not usable(model):
            return 0
        prompt = [int(t) for t in prompt]
        a = save_point(model, len(prompt), mark)
        if not a:
            return 0
        nb = int(model.n_batch)
        have = min(common_prefix(model.tokens, prompt), len(prompt) - 1)
        if have > a:
            return 0
        # the cache must reach `a` as whole chunks from 0 (then, to a mark, one chunk from the last multiple of
        # n_batch): what it holds of the prompt is kept to its cold part's last chunk boundary and the rest decoded
        # again, where that is little beside what the prompt decodes anyway (a short start another prompt shared)
        h = min(have, int(model.cold_upto)) // nb * nb
        if have - h > (a - have) // 8:
            return 0
        key = state_key(model)
        if has(self.store, key, prompt[:a]):
            return 0
        if len(model.tokens) > h:
            model.truncate(h)
        model.fill(prompt[:a])
        if model.cold_upto != a // nb * nb or len(model.tokens) != a:
            return a  # filled, but not as a cold prefill (cannot happen from the checks above): nothing saved
        self._put(model, key, prompt[:a])
        return a

    def save_draft(self, model, prompt: Sequence[int], fill: bool = False, mark: int = 0) -> None:
        """The draft model's state at the prompt's save point, where the store has none: its cache cut back to there
        when it holds more of the prompt (after a request), or filled to there where `fill` (a reopened chat's
        prefill: the catch-up its first proposal would make, made now). A draft's cache need not be a cold prefill's
        (it changes which drafts are proposed, not the emitted tokens), so what it holds is kept as it is."""
        if not usable(model):
            return
        prompt = [int(t) for t in prompt]
        a = save_point(model, len(prompt), mark)
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
        self._put(model, key, prompt[:a])

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
