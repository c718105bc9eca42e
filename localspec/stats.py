"""Generation statistics: a plain dataclass the decoder fills and the CLI/TUI/bench read."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass
class Stats:
    method: str = "none"
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # reused from the previous turn's KV cache
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    target_passes: int = 0  # target decodes during generation (each emits >= 1 token)
    drafted_at: list[int] = field(default_factory=list)  # per draft position: times a token was drafted there
    accepted_at: list[int] = field(default_factory=list)  # per draft position: times it was accepted
    prompt_s: float = 0.0  # prompt decode time (both models)
    ttft_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    elapsed_s: float = 0.0
    k_used: Counter = field(default_factory=Counter)  # k chosen per step (adaptive controller)
    method_used: Counter = field(default_factory=Counter)  # drafter used per step
    k_cap: int = 0  # the k in effect: under bit exactness, the largest whose verify batch is bit-exact (exactness.py)
    exactness: str = "bit"  # the level in use: bit | lossless (see GenConfig.exactness)
    exactness_reason: str = ""  # why, in plain words
    reason: str = ""  # why the controller chose what it did, e.g. "auto -> none: draft 0.91x"

    def record_step(self, n_drafted: int, n_accepted: int) -> None:
        self.target_passes += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        while len(self.drafted_at) < n_drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(n_drafted):
            self.drafted_at[i] += 1
            if i < n_accepted:
                self.accepted_at[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target pass during generation (1.0 = no gain)."""
        return (self.accepted + self.target_passes) / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def generation_s(self) -> float:
        return max(self.elapsed_s - self.prompt_s, 0.0)

    @property
    def tokens_per_second(self) -> float:
        g = self.generation_s
        return self.completion_tokens / g if g > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["k_used"] = {str(k): v for k, v in sorted(self.k_used.items())}
        d["method_used"] = dict(self.method_used)
        d.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            acceptance_by_position=self.acceptance_by_position,
            tokens_per_second=self.tokens_per_second,
        )
        return d
