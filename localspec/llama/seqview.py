"""One sequence of a MultiSeq with the calls a drafter makes of a single-sequence Model: `sync`, `decode`, `reused`,
`n_ctx`, and the model's vocabulary (`piece`, `tokenize_bytes`, `is_control`, `is_eog`, `vocab_info`).

A drafter written against Model (the cross-vocabulary drafter) then drafts for one slot of a batch in that slot's own
sequence of one shared context of the draft model: the slots share the weights and one KV allocation, and no slot's
drafting disturbs another's cache (each keeps its prefix from step to step, as the single-sequence drafter does).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from localspec.seq import common_prefix

_VOCAB_CALLS = ("piece", "tokenize_bytes", "is_control", "is_eog", "vocab_info", "n_vocab", "name", "size_bytes")


class SeqView:
    """Sequence `seq` of `ms` (a MultiSeq over `model`), used as a Model by one drafter. Not thread-safe."""

    def __init__(self, ms, seq: int, model) -> None:
        self.ms = ms
        self.seq = seq
        self.model = model
        self.reused = 0  # context tokens the last sync kept from the cache

    def __getattr__(self, name: str):
        if name in _VOCAB_CALLS:
            return getattr(self.model, name)
        raise AttributeError(name)

    @property
    def rollback_kind(self) -> str:
        return self.ms.rollback_kind

    @property
    def n_ctx(self) -> int:
        return self.ms.n_ctx

    @property
    def tokens(self) -> list[int]:
        return self.ms.tokens[self.seq]

    def decode(self, tokens: Sequence[int], logit_rows="last", copy: bool = True) -> np.ndarray:
        """Append `tokens` to the sequence (in n_batch chunks); the last row's logits, as a (1, n_vocab) array."""
        if logit_rows != "last":
            raise ValueError("a sequence view gives the last row's logits only")
        rest = list(tokens)
        if not rest:
            raise ValueError("decode() needs at least one token")
        n_batch = self.ms.n_batch
        while len(rest) > n_batch:
            self.ms.decode([(self.seq, rest[:n_batch], [])])
            rest = rest[n_batch:]
        return self.ms.decode([(self.seq, rest, [len(rest) - 1])], copy=copy)[0]

    def truncate(self, n_keep: int) -> list[int]:
        """Cut the sequence at n_keep. A recurrent state restored from a checkpoint leaves its replay pending: the
        sequence's next decode (MultiSeq.decode) makes it first, so nothing is decoded again here."""
        self.ms.truncate(self.seq, n_keep)
        return []

    def sync(self, context: Sequence[int], copy: bool = True) -> np.ndarray:
        """Make the sequence hold exactly `context` (keeping the common prefix); return the last row's logits."""
        common = common_prefix(self.ms.tokens[self.seq], context)
        if common == len(context):  # everything cached: decode the last token again for its logits
            common -= 1
        self.ms.truncate(self.seq, common)
        self.reused = common
        return self.decode(context[common:], "last", copy=copy)[0]

    def close(self) -> None:
        """Nothing of its own: the MultiSeq and the model are closed by whoever made them."""
