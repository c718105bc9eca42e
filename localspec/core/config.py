"""One generation's settings, as values: what every scheduler (core/batch.py: alone or in a batch) takes per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from localspec import defaults as D
from localspec.defaults import EXACTNESS, MAX_K, METHODS
from localspec.errors import SettingError
from localspec.sample.sampling import SamplingParams


@dataclass
class GenConfig:
    """One generation's settings, as values (the front ends resolve flags, files and requests into these)."""

    method: str = D.METHOD
    k: int = D.DRAFT_TOKENS  # draft tokens per step (auto: the most it may use; a repeat: policy.repeat_k)
    max_tokens: int = D.MAX_TOKENS
    stop: Sequence[str] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    p_min: float = D.P_MIN
    lookup_min: int = D.LOOKUP_MIN
    lookup_max: int = D.LOOKUP_MAX
    adaptive: bool | None = None  # None: adaptive in auto, fixed k otherwise
    # bit: k capped so verify batches are bit-identical to one-token decoding (output == plain decoding);
    # lossless: no cap, every token is the target's choice in the pass that emitted it (float order may flip
    # near-ties); auto: bit when the cap leaves >= 2 draft tokens, else lossless
    exactness: str = D.EXACTNESS_LEVEL
    # a grammar the output must follow (structured output): an object with allowed() -> bool array over the
    # vocabulary at its current state, consume(tokens) -> bool and rollback(n); None: free text
    constraint: Any = None
    # logprobs: None computes none (no cost); n: each Piece carries its token's logprob and the n likeliest
    # alternatives, from the target row that emitted it (log-softmax of the raw row after bias and grammar)
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # token -> added to the target's logits in every row; <= -100 bans
    # where the part of the prompt that later prompts share ends (`run`'s piped text): the prefill splits there and
    # the prompt cache keeps the state there (core/prompt_cache.py); 0: none
    shared_upto: int = 0

    def __post_init__(self) -> None:
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SettingError(f"logprobs must be between 0 and 20, got {self.logprobs}", "logprobs")
        if self.method not in METHODS:
            raise SettingError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}", "method")
        if self.exactness not in EXACTNESS:
            raise SettingError(f"unknown exactness {self.exactness!r}; choose one of {', '.join(EXACTNESS)}",
                               "exactness")
        if not isinstance(self.k, int) or self.k < 0 or self.k > MAX_K:
            raise SettingError(f"draft tokens ({{draft_tokens}}) must be between 0 and {MAX_K}, got {self.k}",
                               "draft_tokens")
        if self.max_tokens is None or self.max_tokens < 1:
            raise SettingError(f"max tokens ({{max_tokens}}) must be >= 1, got {self.max_tokens}", "max_tokens")
        if not (0.0 <= self.p_min <= 1.0):
            raise SettingError(f"{{p_min}} must be in [0, 1], got {self.p_min}", "p_min")
        if self.lookup_min < 1 or self.lookup_max < self.lookup_min:
            raise SettingError(f"need 1 <= {{lookup_min}} <= {{lookup_max}}, got {self.lookup_min} and "
                               f"{self.lookup_max}", ("lookup_min", "lookup_max"))
