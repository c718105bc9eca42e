"""Prompt states across processes for a request decoded alone (`run`, `chat`: core/solo.py, Engine.prefill): the
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
"""

from __future__ import annotations

import time
from typing import Sequence

from localspec.seq import common_prefix
from localspec.store.prompt_states import aligned, state_key


def usable(model) -> bool:
    """A model whose states are kept: a plain transformer (rollback kind "kv") of llama/model.py."""
    return model is not None and getattr(model, "rollback_kind", "") == "kv" and hasattr(model, "state_bytes")


def save_point(model, n_prompt: int) -> int:
    """Where a prompt of n_prompt tokens saves its prefix's state: the last multiple of the model's n_batch before the
    prompt's last token (which is decoded for its logits), where the store keeps one (block-aligned, long enough);
    0 where there is none."""
    nb = int(model.n_batch)
    a = (int(n_prompt) - 1) // nb * nb if nb > 0 else 0
    return a if a > 0 and aligned(a) == a else 0


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
        if self.store.has(key, prompt[:a]):
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
        if self.store.has(key, prompt[:a]):
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
