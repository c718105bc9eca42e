"""The drafter interface the decoder talks to."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..sampling import SamplingParams


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    # q[i] is the distribution tokens[i] was drawn from (target vocab size); None: deterministic (one-hot)
    q: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(ABC):
    name: str = "drafter"

    @abstractmethod
    def begin(self, context: Sequence[int]) -> None:
        """A generation starts from `context` (the prompt). Cheap to call again with a longer context."""

    @abstractmethod
    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator) -> Proposal:
        """Up to k tokens that may follow `context` (which ends with the target's pending token)."""

    def close(self) -> None:  # pragma: no cover - default no-op
        pass
