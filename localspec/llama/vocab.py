"""The vocabulary facts the pair check needs, from a loaded model or a GGUF header (no llama_cpp import)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class VocabInfo:
    """Facts used by the pair check; built from a loaded model or from a GGUF header."""

    vocab_type: str
    n_vocab: int
    bos: int
    eos: int
    add_bos: bool
    add_eos: bool
    token_text: Sequence[bytes] = field(repr=False, default_factory=list)
