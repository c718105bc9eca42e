"""The kinds of drafter localspec has, by the method name that selects each. A new drafter (a draft head, say)
is one module beside these and one line here; the methods users may name follow from this table."""

from __future__ import annotations

from localspec import defaults
from localspec.drafters.dflash import DFlashDrafter
from localspec.drafters.draft_model import DraftModelDrafter
from localspec.drafters.dspark import DSparkDrafter
from localspec.drafters.eagle3 import Eagle3Drafter
from localspec.drafters.mtp import MtpDrafter
from localspec.drafters.ngram_cache import NgramCacheDrafter
from localspec.drafters.prompt_lookup import PromptLookupDrafter
from localspec.drafters.suffix import SuffixDrafter

KINDS: dict[str, type] = {
    "draft": DraftModelDrafter,  # a separate draft GGUF with the target's vocabulary
    "lookup": PromptLookupDrafter,  # n-grams of the prompt and answer so far
    "ngram": NgramCacheDrafter,  # llama.cpp's n-gram cache: the continuation counted most often, in prompt and answer
    "suffix": SuffixDrafter,  # earlier prompts and answers: this request's, this process's and earlier sessions'
    "eagle3": Eagle3Drafter,  # llama.cpp's EAGLE-3 head (-d HEAD.gguf of arch eagle3) on the target's hidden states
    "mtp": MtpDrafter,  # the target's own MTP (nextn) layers, found in the target GGUF
    "dflash": DFlashDrafter,  # llama.cpp's DFlash block-diffusion head (-d HEAD.gguf of arch dflash; DSpark too)
}


class DFlashHeads:
    """--method dflash runs any `dflash`-arch GGUF: a DSpark head where the file has a Markov head (llama.cpp's
    common_speculative_types_from_gguf tells them apart the same way), else plain DFlash."""

    @staticmethod
    def load(target, path, **kw):
        return (DSparkDrafter if DSparkDrafter.in_file(path) else DFlashDrafter).load(target, path, **kw)


# draft heads: drafters built from the target's own context (HEADS[kind] has .load(target, path, ...))
HEADS: dict[str, type] = {"eagle3": Eagle3Drafter, "mtp": MtpDrafter, "dflash": DFlashHeads}
METHODS = defaults.METHODS
# the settings know the kinds by name without importing a drafter (localspec/defaults.py): the two lists must agree
assert tuple(KINDS) == defaults.DRAFTER_KINDS and tuple(HEADS) == defaults.HEAD_KINDS
