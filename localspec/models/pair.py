"""Can this draft speculate for this target? Mirrors llama.cpp's common_speculative_are_compatible."""

from __future__ import annotations

from localspec.errors import IncompatibleDraftError
from localspec.llama.vocab import VocabInfo


MAX_VOCAB_SIZE_DIFF = 128
CHECK_FROM_TOKEN = 5


def first_difference(target: VocabInfo, draft: VocabInfo) -> str | None:
    """A one-line description of the first incompatibility, or None when the pair can speculate."""
    if target.vocab_type != draft.vocab_type:
        return f"vocab type differs: target {target.vocab_type}, draft {draft.vocab_type}"
    if target.add_bos != draft.add_bos or target.add_eos != draft.add_eos:
        return (
            f"add_bos/add_eos differ: target {target.add_bos}/{target.add_eos}, "
            f"draft {draft.add_bos}/{draft.add_eos}"
        )
    if target.bos != draft.bos or target.eos != draft.eos:
        return f"special tokens differ: target bos={target.bos} eos={target.eos}, draft bos={draft.bos} eos={draft.eos}"
    diff = abs(target.n_vocab - draft.n_vocab)
    if diff > MAX_VOCAB_SIZE_DIFF:
        return f"vocab sizes differ by {diff} (> {MAX_VOCAB_SIZE_DIFF}): target {target.n_vocab}, draft {draft.n_vocab}"
    for i in range(CHECK_FROM_TOKEN, min(target.n_vocab, draft.n_vocab)):
        a, b = target.token_text[i], draft.token_text[i]
        if a != b:
            return f"token {i} differs: target {a!r}, draft {b!r}"
    return None


def check_pair(target: VocabInfo, draft: VocabInfo, target_name: str = "target", draft_name: str = "draft") -> None:
    why = first_difference(target, draft)
    if why:
        raise IncompatibleDraftError(f"draft {draft_name} cannot speculate for {target_name}: {why}")
