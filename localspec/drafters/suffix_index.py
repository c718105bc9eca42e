"""The suffix drafter's index of earlier text: an n-gram index with occurrence chains, not a suffix tree or
automaton. Each indexed n-gram (n in KEYS) maps to its latest occurrence and every occurrence links to the one before
(a hash chain, as llama.cpp's lookup caches), so a match costs a dictionary read and a walk of at most OCC_MAX links,
appending a token costs one hash per key length, and dropping the oldest requests is a rebuild of flat arrays (numpy,
~0.1 s per 100k tokens). A suffix automaton would find the longest match in one walk, but its occurrence counts
cannot be kept up to date incrementally and it cannot forget old text without a rebuild either; a suffix trie of
depth 24 holds ~24 nodes per token (a Python dict each), against ~4 machine ints per token here.
"""

from __future__ import annotations

from array import array
from typing import Sequence

import numpy as np

KEYS = (8, 4, 2)  # n-gram lengths indexed, longest first: the longest one with an occurrence is the match
OCC_MAX = 32  # occurrences of one n-gram looked at, newest first (a frequent gram's old occurrences say little)
DEPTH = 24  # how far back a match is compared (SuffixDecoding's tree depth)
SEP = -1  # between documents in the corpus: never in a context, so no match or continuation crosses it
_P = 0x100000001B3  # n-gram hash multiplier (FNV-64 prime); keys are 64-bit, a collision is caught by the reach check
_MASK = (1 << 64) - 1


def gram_key(tokens: Sequence[int]) -> int:
    h = 0
    for t in tokens:
        h = (h * _P + t) & _MASK
    return h


class NgramIndex:
    """Tokens (SEP between documents) with, per n in KEYS, the latest position e whose preceding n tokens hash to a
    key and the previous such position (`prev[n][e]`, -1: none). A position is indexed only where a continuation
    follows (tokens[e] is a token) and its n-gram holds no SEP. The tokens given at construction are indexed in
    numpy (their latest positions in sorted arrays); those appended later, one by one (a dict over them)."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.toks = array("i")
        self.heads: dict[int, dict[int, int]] = {n: {} for n in KEYS}
        self.prev: dict[int, array] = {n: array("i") for n in KEYS}
        self._bulk: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # n -> (sorted keys, latest position of each)
        self._last_sep = -1
        if len(tokens) > 64:
            self._build(tokens)
        else:
            self.extend(tokens)

    def __len__(self) -> int:
        return len(self.toks)

    def head(self, n: int, key: int) -> int:
        """The latest position whose preceding n-gram hashes to `key` (-1: none)."""
        e = self.heads[n].get(key)
        if e is not None:
            return e
        bulk = self._bulk.get(n)
        if bulk is None:
            return -1
        keys, last = bulk
        i = int(np.searchsorted(keys, np.uint64(key)))
        return int(last[i]) if i < len(keys) and int(keys[i]) == key else -1

    def extend(self, tokens: Sequence[int]) -> None:
        toks = self.toks
        for t in tokens:
            e = len(toks)
            toks.append(t)
            if t == SEP:
                self._last_sep = e
            for n, heads in self.heads.items():
                if t != SEP and e - n > self._last_sep:
                    key = gram_key(toks[e - n:e])
                    self.prev[n].append(self.head(n, key))
                    heads[key] = e
                else:
                    self.prev[n].append(-1)

    def _build(self, tokens: Sequence[int]) -> None:
        """Index a fresh token list at once, in numpy: the same chains as extend() one token at a time."""
        new = np.asarray(tokens, dtype=np.int64)
        self.toks.frombytes(new.astype(np.int32).tobytes())
        seps = np.flatnonzero(new == SEP)
        sep_at = np.full(len(new), -1, dtype=np.int64)
        sep_at[seps] = seps
        sep_before = np.concatenate([[-1], np.maximum.accumulate(sep_at)[:-1]])  # the last SEP before each position
        if len(seps):
            self._last_sep = int(seps[-1])
        pos = np.arange(len(new))
        vals = np.where(new == SEP, 0, new).astype(np.uint64)
        for n in KEYS:
            prev = np.full(len(new), -1, dtype=np.int64)
            sel = np.flatnonzero((new != SEP) & (pos - n > sep_before) & (pos >= n))
            if len(sel):
                keys = np.zeros(len(sel), dtype=np.uint64)
                with np.errstate(over="ignore"):
                    for i in range(n):
                        keys = keys * np.uint64(_P) + vals[sel - n + i]
                order = np.argsort(keys, kind="stable")  # by key, then by position
                k_sorted, p_sorted = keys[order], sel[order]
                same = k_sorted[1:] == k_sorted[:-1]
                prev[p_sorted[1:][same]] = p_sorted[:-1][same]
                last = np.concatenate([~same, [True]])
                self._bulk[n] = (k_sorted[last], p_sorted[last])
            self.prev[n].frombytes(prev.astype(np.int32).tobytes())

    def chain(self, n: int, key: int, limit: int = OCC_MAX):
        """Positions whose preceding n-gram hashes to `key`, newest first, at most `limit`."""
        e = self.head(n, key)
        prev = self.prev[n]
        while e >= 0 and limit > 0:
            yield e
            e = prev[e]
            limit -= 1


def reach(toks, e: int, ctx: Sequence[int]) -> int:
    """How many tokens before position e agree with the context's tail (up to DEPTH; a SEP never agrees)."""
    n, m = 0, len(ctx)
    while n < DEPTH and n < m and e - 1 - n >= 0 and toks[e - 1 - n] == ctx[m - 1 - n]:
        n += 1
    return n
