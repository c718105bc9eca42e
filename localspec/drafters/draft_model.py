"""Draft-model proposer: a small model with the same tokenizer, its own context and KV cache."""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from localspec.sample.sampling import SamplingParams
from localspec.seq import common_prefix
from localspec.drafters.base import Drafter, Proposal, draft_loop


def target_row(logits: np.ndarray, n_vocab: int, copy: bool = False) -> np.ndarray:
    """Draft logits over the target's vocabulary of n_vocab tokens (a token the target lacks is never proposed). A
    view when the vocab sizes agree and not `copy`: this runs once per drafted token, on ~150k floats."""
    if logits.shape[-1] >= n_vocab:
        row = logits[:n_vocab]
        return np.array(row, copy=True) if copy else row
    row = np.full(n_vocab, -np.inf, dtype=logits.dtype)
    row[: logits.shape[-1]] = logits
    return row


def confident(row: np.ndarray, p_min: float) -> bool:
    """Whether a draft model is sure enough to draft from `row`: its top token's probability at temperature 1 is at
    least p_min (p_min <= 0: always)."""
    return p_min <= 0.0 or 1.0 / float(np.exp(row - row.max()).sum()) >= p_min


class DraftModelDrafter(Drafter):
    name = "draft"
    prior_alpha = 0.6

    def __init__(self, model, n_vocab_target: int, p_min: float = 0.75, cost: float | None = None) -> None:
        """cost: the draft cost per token relative to one target step until measured (decoding is memory-bound:
        the draft's file size over the target's is a fair first guess)."""
        self.model = model  # llama.model.Model (or anything with sync/decode/tokens); its truncate rolls back any kind
        self.n_vocab = n_vocab_target
        self.p_min = p_min
        self._cost = cost

    # begin(): lazy; the prompt is decoded at the first propose(), so a controller that never picks the draft
    # model never pays for it (that catch-up time is reported apart from the per-token draft cost)

    def cost(self) -> float | None:
        return self._cost

    def lag(self, context: Sequence[int]) -> int:
        """Tokens the draft model would have to decode to catch up with `context` (its KV cache trails it)."""
        return len(context) - common_prefix(self.model.tokens, context)

    def _row(self, logits: np.ndarray) -> np.ndarray:
        return target_row(logits, self.n_vocab)

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator) -> Proposal:
        if k <= 0:
            return Proposal()
        # leave room: the draft decodes at most k-1 tokens after syncing the context
        room = self.model.n_ctx - len(context) - 1
        k = min(k, max(room, 0))
        if k <= 0:
            return Proposal()
        t0 = time.perf_counter()
        logits = self.model.sync(context, copy=False)  # read before the next decode
        catch_up = time.perf_counter() - t0 if len(context) - self.model.reused > 2 else 0.0
        if k > 1:
            # a recurrent/hybrid draft model saves its state here: the next sync rolls back into these one-token
            # decodes, which a recurrent state cannot undo (llama/model.py; a no-op for a transformer)
            mark = getattr(self.model, "save_checkpoint", None)
            if mark is not None:
                mark()
        p_min = self.p_min
        out = draft_loop(self._row(logits), k, sp, rng,
                         lambda t, i: self._row(self.model.decode([t], "last", copy=False)[0]),
                         lambda row: confident(row, p_min))
        out.catch_up_s = catch_up
        return out

    def close(self) -> None:
        self.model.close()
