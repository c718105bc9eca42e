"""Draft-model proposer: a small model with the same tokenizer, its own context and KV cache."""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from ..sampling import SamplingParams, probs, sample
from .base import Drafter, Proposal


class DraftModelDrafter(Drafter):
    name = "draft"

    def __init__(self, model, n_vocab_target: int, p_min: float = 0.75) -> None:
        self.model = model  # backend.Model (or anything with sync/decode/tokens)
        self.n_vocab = n_vocab_target
        self.p_min = p_min

    last_sync_s: float = 0.0  # time the last propose() spent catching up with the context (prompt included)

    def begin(self, context: Sequence[int]) -> None:
        # lazy: the prompt is decoded at the first propose(), so a controller that never picks the draft
        # model never pays for it (its sync time is reported apart from the per-token draft cost)
        pass

    def _row(self, logits: np.ndarray) -> np.ndarray:
        """Draft logits restricted to the target's vocabulary (a token the target lacks is never proposed)."""
        n = min(self.n_vocab, logits.shape[-1])
        row = np.full(self.n_vocab, -np.inf, dtype=np.float64)
        row[:n] = logits[:n]
        return row

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator) -> Proposal:
        if k <= 0:
            return Proposal()
        # leave room: the draft decodes at most k-1 tokens after syncing the context
        room = self.model.n_ctx - len(context) - 1
        k = min(k, max(room, 0))
        if k <= 0:
            return Proposal()
        t0 = time.perf_counter()
        logits = self.model.sync(context)
        self.last_sync_s = time.perf_counter() - t0 if len(context) - self.model.reused > 2 else 0.0
        tokens: list[int] = []
        qs: list[np.ndarray] = []
        for i in range(k):
            row = self._row(logits)
            m = row.max()
            top_p = 1.0 / np.exp(row - m).sum()  # the draft's own confidence at temperature 1
            if top_p < self.p_min:
                break
            if sp.greedy:
                t = int(np.argmax(row))
            else:
                q = probs(row, sp)
                t = sample(q, rng)
                qs.append(q)
            tokens.append(t)
            if i < k - 1:
                logits = self.model.decode([t], "last")[0]
        q = np.stack(qs) if qs else None
        return Proposal(tokens, q)

    def close(self) -> None:
        self.model.close()
