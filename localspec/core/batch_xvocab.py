"""A draft model of another vocabulary for the slots of a BatchEngine.

The cross-vocabulary drafter (drafters/cross_vocab.py) drafts through text: each slot's drafter keeps the text of its
own context and the draft's tokenization of it, and decodes the draft's own tokens, so its decodes cannot be shared
row for row with another slot's as a same-vocabulary draft's are (core/batch_draft.py). Here every slot gets its own
drafter over its own sequence of ONE multi-sequence context of the draft model (llama/seqview.py): the slots share the
weights and one KV allocation, each keeps its cache prefix from step to step as the single-sequence drafter does, and
each drafts on its own decodes, timed as its own draft time (Generation.propose). A recurrent draft model rolls each
slot's sequence back on its own, as a draft model of the target's vocabulary does.
"""

from __future__ import annotations

from localspec.core.batch_draft import NO_ROLLBACKS
from localspec.drafters.base import Drafter


def cross_vocab(engine) -> bool:
    return engine.draft is not None and getattr(engine, "draft_kind", None) == "cross-vocab"


class CrossVocabSlots:
    """Per slot, a cross-vocabulary drafter on its own sequence of the draft model. The draft's context is made at the
    first draft, so a server whose requests never use the draft model does not hold its KV cache."""

    def __init__(self, engine, n_slots: int) -> None:
        self.engine = engine
        self.n_slots = n_slots
        self.ms = None
        self.slots: list[Drafter | None] = [None] * n_slots
        self.cost = engine.draft.size_bytes() / max(engine.target.size_bytes(), 1)  # decoding is memory-bound

    @classmethod
    def for_engine(cls, engine, n_slots: int) -> "CrossVocabSlots | None":
        """None unless the engine's draft model has another vocabulary than its target and a state it can roll back
        (a KV cache; a recurrent state by a plane or a checkpoint: each slot's sequence rolls back on its own,
        llama/multiseq.py)."""
        if not cross_vocab(engine) or engine.draft.rollback_kind == "none":
            return None
        return cls(engine, n_slots)

    @property
    def rollback_kind(self) -> str:
        """How a slot's rejected drafts leave its sequence: the MultiSeq's kind, or the model's before it exists."""
        return self.ms.rollback_kind if self.ms is not None else self.engine.draft.rollback_kind

    def rollback_counters(self, seq: int) -> dict:
        """Slot `seq`'s rollback counters on the draft model (zeros before its first draft)."""
        return self.ms.rollback_counters(seq) if self.ms is not None else dict(NO_ROLLBACKS)

    def drafter(self, seq: int, p_min: float) -> Drafter:
        from localspec.drafters.cross_vocab import CrossVocabDrafter
        from localspec.llama.multiseq import MultiSeq
        from localspec.llama.seqview import SeqView

        if self.ms is None:
            self.ms = MultiSeq(self.engine.draft, self.n_slots)
        d = self.slots[seq]
        if d is None:
            view = SeqView(self.ms, seq, self.engine.draft)
            d = self.slots[seq] = CrossVocabDrafter(view, self.engine.target, p_min, cost=self.cost)
        d.p_min = p_min
        return d

    def close(self) -> None:
        if self.ms is not None:
            self.ms.close()
            self.ms = None
        self.slots = [None] * self.n_slots
