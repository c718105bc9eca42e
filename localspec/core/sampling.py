"""Turn logits into the distribution we sample from. The same function shapes the target's p and the
draft's q, so speculative sampling reproduces exactly what plain sampling would draw.

Order: temperature, then top-k, top-p, min-p on the tempered distribution, then renormalise.
Temperature 0 means greedy (a one-hot on the argmax; ties go to the lowest id, as numpy's argmax).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from localspec.errors import SettingError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if t is None or not math.isfinite(t) or t < 0:
            raise SettingError(f"temperature must be a finite number >= 0, got {t}", "temperature")
        if self.top_k < 0:
            raise SettingError(f"top-k ({{top_k}}) must be >= 0, got {self.top_k}", "top_k")
        if not (0.0 < self.top_p <= 1.0) or not math.isfinite(self.top_p):
            raise SettingError(f"top-p ({{top_p}}) must be in (0, 1], got {self.top_p}", "top_p")
        if not (0.0 <= self.min_p < 1.0) or not math.isfinite(self.min_p):
            raise SettingError(f"min-p ({{min_p}}) must be in [0, 1), got {self.min_p}", "min_p")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs(logits: np.ndarray, sp: SamplingParams) -> np.ndarray:
    """Distribution over the vocabulary (float64, sums to 1) for one row of logits."""
    x = np.asarray(logits, dtype=np.float64)
    n = x.shape[-1]
    if sp.greedy:
        p = np.zeros(n)
        p[int(np.argmax(x))] = 1.0
        return p
    x = x / sp.temperature
    keep = np.ones(n, dtype=bool)
    if sp.top_k and sp.top_k < n:
        kth = np.partition(x, n - sp.top_k)[n - sp.top_k]
        keep &= x >= kth
    m = np.max(x)
    e = np.exp(x - m)
    e[~keep] = 0.0
    p = e / e.sum()
    if sp.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        c = np.cumsum(p[order])
        # smallest prefix whose mass reaches top_p
        cut = int(np.searchsorted(c, sp.top_p)) + 1
        mask = np.zeros(n, dtype=bool)
        mask[order[:cut]] = True
        p = np.where(mask, p, 0.0)
    if sp.min_p > 0.0:
        p = np.where(p >= sp.min_p * p.max(), p, 0.0)
    return p / p.sum()


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one index from a (possibly unnormalised) non-negative vector."""
    c = np.cumsum(p)
    total = c[-1]
    if not total > 0:
        raise ValueError("cannot sample from an all-zero distribution")
    i = int(np.searchsorted(c, rng.random() * total, side="right"))
    return min(i, len(p) - 1)
