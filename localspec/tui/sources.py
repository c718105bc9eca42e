"""What each drafting source (lookup, suffix, the draft model, a head) drafted and the target accepted over one
answer, and how that source drafts, for the stats panel.

The figures are read off the answer's Stats as its events stream: the single-sequence engine (the one the chat uses)
yields a step's pieces only after the step has been recorded, so between two events at most one step was added, and
the source whose step count rose drafted all of that step's tokens. The kind of a draft model is the engine's
draft_kind, the field `run --json` reports, put in the words `models pairs` uses."""

from __future__ import annotations

from collections import Counter

from localspec.defaults import HEAD_KINDS
from localspec.models.local import HOW_WORDS

MODEL_FREE = "model-free"  # drafts from text already seen (prompt lookup, the suffix cache): no model runs


def source_kind(source: str, draft_kind: str | None) -> str:
    """How `source` drafts: the draft model as its pair's kind (same vocabulary, through text), a head, or
    model-free."""
    if source == "draft":
        return HOW_WORDS.get(draft_kind or "", "draft model")
    if source in HEAD_KINDS:
        return HOW_WORDS["head"]
    return MODEL_FREE


class SourceTally:
    """Drafted and accepted tokens per source over one answer; `see(stats)` after each of the answer's events."""

    def __init__(self) -> None:
        self.by_source: dict[str, tuple[int, int]] = {}  # source -> (drafted, accepted)
        self._drafted = self._accepted = 0
        self._steps: Counter = Counter()

    def see(self, stats) -> None:
        drafted, accepted = stats.drafted - self._drafted, stats.accepted - self._accepted
        steps = Counter(stats.method_used)
        rose = steps - self._steps
        rose.pop("none", None)
        if drafted and rose:
            source = rose.most_common(1)[0][0]
            d, a = self.by_source.get(source, (0, 0))
            self.by_source[source] = (d + drafted, a + accepted)
        self._drafted, self._accepted, self._steps = stats.drafted, stats.accepted, steps

    def snapshot(self) -> dict[str, tuple[int, int]]:
        return dict(self.by_source)
