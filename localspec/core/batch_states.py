"""Prompt states in a batch's slots (core/prompt_cache.py, the server's store): the part of the BatchEngine
(core/batch.py) that restores a kept state into a joining request's slot and keeps a slot's state.

A request restores the longest kept state of its prompt's start that no slot holds, from memory or disk, and a slot's
state is kept at the prompt's last multiple of the chunk (`_save`) where the slot decoded it as a cold prefill here
does (whole chunks from 0, each alone in its llama_decode: MultiSeq.cold). So a restored prefix holds the bytes the
same prompt decoded alone gives, the rest is decoded as it then would be, and the request's exactness is that of the
same request without the cache. Alone on the target's own context there is no such store here: the target's sync
keeps its states (Engine.sync_prompt).
"""
from __future__ import annotations


class SlotStates:
    """Mixed into BatchEngine: it provides ms, target, states, prefill_chunk and _states_key."""

    @property
    def state_chunk(self) -> int:
        """The chunk a joining prompt is decoded in when nothing else runs (what a kept state's prefix is made of)."""
        return min(self.prefill_chunk, self.ms.n_batch)

    def _track_cold(self) -> None:
        self._states_key = ""
        self.ms.cold_chunk = self.state_chunk if self._keeps_states() else 0

    def _keeps_states(self) -> bool:
        from localspec.core.prompt_cache import usable

        return self.states is not None and usable(self.target) and not self.ms.recurrent

    def _key(self) -> str:
        if not self._states_key:
            from localspec.core.prompt_cache import batch_key

            self._states_key = batch_key(self.target, self.state_chunk, self.ms.unified)
        return self._states_key

    def _restore(self, seq: int, prompt: list[int], common: int) -> tuple[int, str]:
        """Slot `seq` holding `common` tokens of `prompt` (its own or another slot's): the longest kept state of a
        longer prefix (never the whole prompt: its last token is decoded for logits) restored into it. Returns
        (the prompt tokens the slot holds, where the state came from: "memory" or "disk"; "" when none was
        restored)."""
        if not self._keeps_states() or len(prompt) < 2:
            return common, ""
        from localspec.core.prompt_cache import find

        if self.ms.cold_chunk != self.state_chunk:
            self._track_cold()
        try:
            hit = find(self.states, self._key(), prompt[:-1], longer_than=common)
        except OSError:
            return common, ""
        if hit is None:
            return common, ""
        n, data, source = hit
        if n % self.state_chunk == 0 and self.ms.restore_state(seq, prompt[:n], data, cold=True):
            return n, source
        return self.ms.take_prefix(seq, prompt), ""  # refused: the slot is empty now; what another slot has

    def _save(self, run) -> None:
        """Keep slot run.seq's state where its prompt's save point was just reached as a cold prefill here (the
        store has none of it yet)."""
        from localspec.core.prompt_cache import has

        keep, seq = run.keep, run.seq
        a = len(keep)
        if not a or len(self.ms.tokens[seq]) != a or self.ms.cold[seq] < a:
            return
        run.keep = []
        key = self._key()
        try:
            if has(self.states, key, keep):
                return
            data = self.ms.state_of(seq)
            if data:
                self.states.put(key, keep, data, label=self.target.name)
        except OSError:
            pass

    def _keep_point(self, seq: int, prompt: list[int], common: int) -> list[int]:
        """The prefix of `prompt` whose state slot `seq` keeps once it holds it (_save): the prompt's last multiple of
        the chunk, where the slot holding `common` tokens decodes the rest as a cold prefill does; [] for none."""
        if not self._keeps_states():
            return []
        from localspec.core.prompt_cache import chunk_save_point

        a = chunk_save_point(self.state_chunk, len(prompt))
        cold = self.ms.cold[seq] == common and common % self.state_chunk == 0  # the rest decoded as cold
        return prompt[:a] if a > common and cold else []
