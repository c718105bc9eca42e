"""Draft heads in batch slots: a request with --method eagle3, dflash (a DSpark head too) or mtp decodes in a slot
beside other requests (core/batch.py).

A head drafts from the target's hidden states of every decode of its sequence. In a batch, a slot's target rows are
part of the BatchEngine's MultiSeq decode, interleaved with the other slots' rows; llama.cpp extracts the layer
inputs (or the nextn states) of every row there, and llama/taps.SeqTap reads one slot's range. So each slot that runs
a head gets a drafter of its own on the engine's loaded head (Drafter.for_sequence: its own head context, the head's
weights shared), fed after every batched decode with that slot's rows (prompt chunks, verify rows, padding), exactly
as the engine's drafter is fed from the target's own context: its cache follows the slot's sequence by position, so
a rollback needs nothing here (the next decode drops what the slot no longer holds).

A slot keeps its drafters from request to request (a head context is an allocation); a new request in the slot tells
them how much of what they read still holds for its prompt (`keep`).
"""

from __future__ import annotations

import time
from typing import Sequence

from localspec.seq import common_prefix


class BatchHeads:
    """The head drafters of a BatchEngine's slots, over its MultiSeq `ms`. Not thread-safe (the batch's thread)."""

    def __init__(self, engine, ms) -> None:
        self.engine = engine
        self.ms = ms
        self._slot: dict[tuple[int, str], object] = {}  # (seq, method) -> that slot's drafter
        self._seen: dict[tuple[int, str], list[int]] = {}  # ... the tokens its state was read from
        self.active: dict[int, dict[str, object]] = {}  # seq -> the drafters of the request running there, by method

    def drafter(self, seq: int, method: str, p_min: float, prompt: Sequence[int], cached: int):
        """Slot `seq`'s drafter for `method`, for a request whose prompt the slot's cache holds the first `cached`
        tokens of: what the drafter read before holds for the prompt's common prefix with the text it read it from,
        and no further."""
        key = (seq, method)
        d = self._slot.get(key)
        if d is None:
            from localspec.llama.taps import SeqTap  # lazily: core reaches llama.cpp through the llama package

            d = self._slot[key] = self.engine.heads[method].for_sequence(SeqTap(self.ms, seq))
        else:
            d.keep(min(common_prefix(self._seen.get(key, []), prompt), cached))
        d.p_min = p_min
        self.active.setdefault(seq, {})[method] = d
        return d

    def release(self, seq: int) -> None:
        """The request in slot `seq` ended: its drafter's state is that of the slot's cached tokens."""
        for method in self.active.pop(seq, {}):
            self._seen[(seq, method)] = list(self.ms.tokens[seq])

    def after_decode(self, parts: Sequence[tuple]) -> dict[int, float]:
        """Feed each head slot its rows of the decode that just ran (before the next one overwrites them).
        Returns the seconds each slot's drafter took (part of what that request's step cost)."""
        spent = {}
        for seq, toks, _ in parts:
            on = self.active.get(seq)
            if not on:
                continue
            t0 = time.perf_counter()
            base = len(self.ms.tokens[seq]) - len(toks)
            for d in on.values():
                d.after_target_decode(toks, range(base, base + len(toks)))
            spent[seq] = time.perf_counter() - t0
        return spent

    def clear(self) -> None:
        """The slots' caches were cleared: no drafter's state holds any more."""
        for d in self._slot.values():
            d.keep(0)
        self._seen.clear()
        self.active.clear()

    def close(self) -> None:
        for d in self._slot.values():
            d.close()
        self._slot.clear()
        self._seen.clear()
        self.active.clear()
