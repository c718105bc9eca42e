"""Can this draft speculate for this target, and how? With the same vocabulary (llama.cpp's
common_speculative_are_compatible) its tokens are the target's; with another one it drafts through text
(drafters/cross_vocab.py): any draft with a tokenizer can, whatever its merges or special tokens."""

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


SAME_VOCAB, CROSS_VOCAB = "same-vocab", "cross-vocab"
KIND_WORDS = {SAME_VOCAB: "same vocabulary", CROSS_VOCAB: "through text (another vocabulary)", "head": "head"}
NO_TOKENIZER = ("none", "unknown")  # vocab types without a tokenizer: no text goes in or comes out


def text_difference(target: VocabInfo, draft: VocabInfo) -> str | None:
    """Why `draft` cannot draft for `target` even through text (None: it can): one of them has no tokenizer."""
    for role, v in (("target", target), ("draft", draft)):
        if v.vocab_type in NO_TOKENIZER or v.n_vocab == 0:
            return f"the {role} has no tokenizer (vocab type {v.vocab_type}), so no text can pass between them"
    return None


def pair_kind(target: VocabInfo, draft: VocabInfo) -> tuple[str | None, str | None]:
    """(kind, why): SAME_VOCAB with the vocabularies' agreement, CROSS_VOCAB with their first difference (why the
    tokens cannot be shared), or (None, why) when the draft cannot draft for the target at all."""
    diff = first_difference(target, draft)
    if diff is None:
        return SAME_VOCAB, None
    why = text_difference(target, draft)
    return (None, why) if why else (CROSS_VOCAB, diff)


def check_pair(target: VocabInfo, draft: VocabInfo, target_name: str = "target", draft_name: str = "draft") -> str:
    """The kind of drafting this pair does (SAME_VOCAB, CROSS_VOCAB), or IncompatibleDraftError."""
    kind, why = pair_kind(target, draft)
    if kind is None:
        raise IncompatibleDraftError(f"draft {draft_name} cannot speculate for {target_name}: {why}")
    return kind
