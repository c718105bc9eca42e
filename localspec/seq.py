"""Token-sequence helpers shared by the KV caches and the drafters."""

from __future__ import annotations

from typing import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case (one extends the other), compared at C speed
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i
