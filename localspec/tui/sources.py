"""How each drafting source (lookup, ngram, suffix, the draft model, a head) drafts, for the stats panel: the kind of a
draft model is the engine's draft_kind, the field `run --json` reports, put in the words `models pairs` uses."""

from __future__ import annotations

from localspec.defaults import HEAD_KINDS
from localspec.models.local import HOW_WORDS

MODEL_FREE = "model-free"  # drafts from text already seen (prompt lookup, the n-gram cache, the suffix cache): no model runs


def source_kind(source: str, draft_kind: str | None) -> str:
    """How `source` drafts: the draft model as its pair's kind (same vocabulary, through text), a head, or
    model-free."""
    if source == "draft":
        return HOW_WORDS.get(draft_kind or "", "draft model")
    if source in HEAD_KINDS:
        return HOW_WORDS["head"]
    return MODEL_FREE
