"""The kinds of drafter localspec has, by the method name that selects each. A new drafter (a draft head, say)
is one module beside these and one line here; the methods users may name follow from this table."""

from __future__ import annotations

from localspec.drafters.draft_model import DraftModelDrafter
from localspec.drafters.prompt_lookup import PromptLookupDrafter

KINDS: dict[str, type] = {
    "draft": DraftModelDrafter,  # a separate draft GGUF with the target's vocabulary
    "lookup": PromptLookupDrafter,  # n-grams of the prompt and answer so far
}
METHODS = ("auto", *KINDS, "none")  # auto: the controller picks among the drafters; none: plain decoding
