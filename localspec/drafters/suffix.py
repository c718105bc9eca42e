"""Suffix drafter: drafts from earlier prompts and answers, of this request, of earlier requests in this process, and
of earlier sessions (a corpus persisted by store/suffixcache.py), after SuffixDecoding (vLLM `method: suffix`); and,
where none of those match, from a static corpus built from a folder (`localspec cache build`), as llama.cpp's
lookup falls back on its static n-gram cache. The corpus it drafts from: drafters/suffix_corpus.py; the index it
matches in: drafters/suffix_index.py.

A match is the longest context tail (up to DEPTH tokens) that occurred before; the proposal follows what came after
those occurrences by majority, token by token, while the continuation's share of them stays at SHARE_MIN or above
(two earlier answers that split there halve it), so its length follows its confidence. Where the occurrences disagree
on the very next token (no continuation holds AGREE of them), nothing is proposed.
"""

from __future__ import annotations

import time
import uuid
from typing import Callable, Sequence

import numpy as np

from localspec.sample.sampling import SamplingParams
from localspec.seq import common_prefix
from localspec.drafters.base import Drafter, Offer, Proposal
from localspec.drafters.suffix_corpus import Doc, SuffixCorpus
from localspec.drafters.suffix_index import DEPTH, KEYS, SEP, NgramIndex, gram_key, reach

SHARE_MIN = 0.4  # a continuation is proposed while its share of the matched occurrences stays at least this
# beside prompt lookup (auto), only matches into earlier requests are offered (lookup drafts the request's own text,
# and two estimates of the same matches doubled what auto spent finding out they do not pay), from this reach on
CORPUS_REACH_MIN = 4
# ... or shorter, where at least two earlier occurrences agree on the next token by this share: the counts' own
# judgement, as llama.cpp's -lcd cache asks of earlier runs' n-grams (2-4 occurrences, 66-75%). Where they disagree,
# the match is not offered at all. On the recorded repeated-work series the next token was accepted after 0.8 of the
# short matches whose occurrences agreed, 0.34 of those with one occurrence and 0.2 of those whose occurrences split
# (docs/design.md, "Where earlier occurrences agree")
AGREE = 2 / 3
_LIVE = 1 << 40  # the recency rank of the request's own occurrences: newer than any in the corpus
# reach -> the estimate that judges the proposal, and the acceptance it starts from until its shadows are judged. A
# match that reaches 12 tokens back is a copy in progress (prompt_lookup.REACH_BANDS); shorter matches into earlier
# requests often stand on shared boilerplate (the chat template, a code preamble), so they start lower than lookup's:
# with lookup's priors the replay drafted them at a loss (docs/benchmarks.md, "By the reach of its match").
REACH_BANDS = ((0, 3, "2-3", 0.3), (4, 11, "4-11", 0.4), (12, DEPTH, "12+", 0.9))
# a continuation of an earlier request whose match reaches this far back is a repeat of that text, offered beyond the
# request's k (Offer.repeat): accepted whole far more often than a copy inside one request, it pays for a wider verify
# where the copy does not (docs/benchmarks.md, "Repeats")
REPEAT_REACH = 12



class SuffixDrafter(Drafter):
    """Proposes the continuation that most often followed the context's longest earlier match, in this request or
    in `corpus` (None: this request only). Free to ask and a function of the context: judged by its shadow, as
    prompt lookup is. beside_lookup: prompt lookup drafts too (auto), so only matches into the corpus are offered,
    those that reach CORPUS_REACH_MIN tokens back and shorter ones that earlier occurrences agree on (AGREE)."""

    name = "suffix"
    shadowed = True

    def __init__(self, corpus: SuffixCorpus | None = None, share_min: float = SHARE_MIN,
                 clock: Callable[[], float] = time.time, beside_lookup: bool = False) -> None:
        self.corpus = corpus
        self.share_min = share_min
        self.beside_lookup = beside_lookup
        self.clock = clock
        self._ctx: list[int] | None = None  # the request's context as the generation grows it (its own list)
        self._doc = Doc("", 0.0, [])
        self._live = NgramIndex()
        self._memo: tuple | None = None
        if corpus is not None:
            corpus.attach(self)

    # ------------------------------------------------------------ the request in progress
    def begin(self, context: Sequence[int]) -> None:
        prev = self._ctx
        if prev is context:  # the same generation, asked again
            self._sync(context)
            return
        if prev is not None and common_prefix(prev, context) == len(prev):  # a continued chat: the document grows
            self._ctx = context if isinstance(context, list) else list(context)
            self._sync(self._ctx)
            return
        if prev is not None:
            self.finish()
        self._ctx = context if isinstance(context, list) else list(context)
        self._doc = Doc(uuid.uuid4().hex, self.clock(), [])
        self._live = NgramIndex(self._ctx)
        self._memo = None

    def finish(self) -> None:
        """The request in progress is over: it joins the corpus, where the next requests find it."""
        if self._ctx is not None and self.corpus is not None:
            self.corpus.commit(Doc(self._doc.id, self._doc.t, list(self._ctx)))
        self._ctx = None
        self._live = NgramIndex()
        self._memo = None

    def snapshot(self) -> Doc | None:
        """The request in progress as a document (what a save keeps of it)."""
        if self._ctx is None or len(self._ctx) < 2:
            return None
        return Doc(self._doc.id, self._doc.t, list(self._ctx))

    def _sync(self, context: Sequence[int]) -> None:
        """Index the context's new tokens; a context that is not a continuation starts over."""
        known = len(self._live)
        if len(context) < known or (known and context[known - 1] != self._live.toks[-1]):
            self._live = NgramIndex(context)
            self._memo = None
        elif len(context) > known:
            self._live.extend(context[known:])

    # ------------------------------------------------------------ matching
    def match(self, context: Sequence[int], k: int) -> tuple[list[int], int]:
        """(up to k proposed tokens, how far back the match reaches); ([], 0) without a confident match."""
        tokens, reach, _ = self._match(context, k)
        return tokens, reach

    def _match(self, context: Sequence[int], k: int) -> tuple[list[int], int, bool]:
        """match(), and whether an occurrence it continues is in an earlier request (not this one's own text)."""
        self.begin(context)  # the same list as the generation's: a length check; else a continuation or a new one
        version = self.corpus.version if self.corpus is not None else 0
        memo = self._memo
        if memo is not None and memo[0] == (len(context), version) and (memo[1] >= k or len(memo[2]) < memo[1]):
            return memo[2][:k], memo[3], memo[4]
        reach, cands = self._candidates(context)
        if len(cands) > 1 and not _agreed(cands):
            cands = []
        if self.beside_lookup and cands:
            older = [c for c in cands if c[2] < _LIVE]  # occurrences in earlier requests
            if not older or (reach < CORPUS_REACH_MIN and not (len(older) > 1 and _agreed(older))):
                cands = []
        tokens = self._continue(cands, k) if cands else []
        earlier = any(c[2] < _LIVE for c in cands)
        self._memo = ((len(context), version), k, tokens, reach, earlier)
        return tokens, reach, earlier

    def continuation(self, context: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that may follow `context`: the request's context (indexed) followed by tokens another
        drafter proposed (not indexed: they may be rejected). Any match counts here, also into the request itself
        (a chain: drafters/chain.py)."""
        if k <= 0:
            return []
        _, cands = self._candidates(context)
        return self._continue(cands, k) if cands else []

    def _candidates(self, ctx: Sequence[int]) -> tuple[int, list[tuple]]:
        """(reach, occurrences that reach that far back as (tokens, position, recency)) for the longest key length
        with an occurrence in this request or the earlier ones, else in the static corpus (a lower tier: text the
        user's requests wrote beats a folder's); the newest OCC_MAX occurrences of each index are looked at."""
        sources = [(self._live, _LIVE)] + ([(self.corpus.index, 0)] if self.corpus is not None else [])
        found = self._tier(ctx, sources)
        static = self.corpus.static if self.corpus is not None else None
        if not found[1] and static is not None:
            found = self._tier(ctx, [(static, 0)])
        return found

    @staticmethod
    def _tier(ctx: Sequence[int], sources: list) -> tuple[int, list[tuple]]:
        for n in KEYS:
            if len(ctx) < n:
                continue
            key = gram_key(ctx[-n:])
            found = []
            for idx, rank in sources:
                for e in idx.chain(n, key):
                    r = reach(idx.toks, e, ctx)
                    if r >= n:  # else a hash collision
                        found.append((r, idx.toks, e, rank + e))
            if found:
                best = max(f[0] for f in found)
                return best, [f[1:] for f in found if f[0] == best]
        return 0, []

    def _continue(self, cands: list[tuple], k: int) -> list[int]:
        """The majority continuation of the occurrences, token by token, while its share of them (counted from
        the first token) stays at least share_min; ties go to the newest occurrence."""
        out: list[int] = []
        share = 1.0
        for j in range(k):
            votes: dict[int, list] = {}
            for toks, e, rank in cands:
                i = e + j
                if i < len(toks):
                    t = toks[i]
                    if t != SEP:
                        v = votes.get(t)
                        if v is None:
                            votes[t] = [1, rank, [(toks, e, rank)]]
                        else:
                            v[0] += 1
                            v[1] = max(v[1], rank)
                            v[2].append((toks, e, rank))
            if not votes:
                break
            t, (count, _, members) = max(votes.items(), key=lambda kv: (kv[1][0], kv[1][1]))
            share *= count / len(cands)
            if share < self.share_min:
                break
            out.append(int(t))
            cands = members
        return out

    # ------------------------------------------------------------ the drafter contract
    def offer(self, context: Sequence[int], k: int) -> Offer | None:
        """The continuation this step would propose, judged by how far back its match reaches (keys
        "suffix@2-3", "suffix@4-11", "suffix@12+", as prompt lookup's)."""
        if k <= 0:
            return None
        tokens, reach, earlier = self._match(context, k)
        if not tokens:
            return None
        band, prior = next((b, p) for lo, hi, b, p in REACH_BANDS if lo <= reach <= hi)
        return Offer(len(tokens), f"{self.name}@{band}", prior, repeat=earlier and reach >= REPEAT_REACH)

    def cost(self) -> float:
        return 0.0  # dictionary reads and a short walk, next to nothing beside a target step

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator) -> Proposal:
        if k <= 0:
            return Proposal()
        tokens, _ = self.match(context, k)
        return Proposal(tokens, None)


def _agreed(cands: list[tuple]) -> bool:
    """Whether AGREE of the occurrences `cands` ((tokens, position, recency)) are followed by the same token."""
    votes: dict[int, int] = {}
    for toks, e, _ in cands:
        if e < len(toks) and toks[e] != SEP:
            votes[toks[e]] = votes.get(toks[e], 0) + 1
    return bool(votes) and max(votes.values()) >= AGREE * len(cands)
