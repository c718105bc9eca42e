"""Suffix drafter: drafts from earlier prompts and answers, of this request, of earlier requests in this process, and
of earlier sessions (a corpus persisted by store/suffixcache.py), after SuffixDecoding (vLLM `method: suffix`); and,
where none of those match, from a static corpus built from a folder (`localspec cache build`), as llama.cpp's
lookup falls back on its static n-gram cache. The index it matches in: drafters/suffix_index.py.

A match is the longest context tail (up to DEPTH tokens) that occurred before; the proposal follows what came after
those occurrences by majority, token by token, while the continuation's share of them stays at SHARE_MIN or above
(two earlier answers that split there halve it), so its length follows its confidence. Where the occurrences disagree
on the very next token (no continuation holds AGREE of them), nothing is proposed.
"""

from __future__ import annotations

import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from localspec.sample.sampling import SamplingParams
from localspec.seq import common_prefix
from localspec.drafters.base import Drafter, Offer, Proposal
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


@dataclass
class Doc:
    """One request's tokens (prompt and answer) as the corpus keeps them; `t` orders eviction (oldest first)."""

    id: str
    t: float
    tokens: list[int]


def flat_index(docs: Sequence[Doc]) -> NgramIndex:
    """The index of `docs` in order, a SEP between two."""
    flat: list[int] = []
    for d in docs:
        flat += ([SEP] if flat else []) + d.tokens
    return NgramIndex(flat)


class SuffixCorpus:
    """The finished requests of one scope (a process's requests, or those of one API key), oldest first, with their
    index. `store` (store/suffixcache.SuffixFile, or None: nothing persists) saves them across sessions: the docs
    added here since the last save and the requests in progress, merged into the file under its lock. `static`: the
    index of a static corpus (a folder's text), drafted from only where the requests match nothing."""

    def __init__(self, max_tokens: int, docs: Sequence[Doc] = (), store=None, save_every_s: float = 60.0,
                 static: NgramIndex | None = None) -> None:
        self.max_tokens = max(0, int(max_tokens))
        self.store = store
        self.static = static
        self.save_every_s = save_every_s
        self.docs: list[Doc] = []
        self.total = 0
        self.version = 0  # bumped on every change: a drafter's memo of its last match is then stale
        self.index = NgramIndex()
        self._unsaved: dict[str, Doc] = {}
        self._live: weakref.WeakSet = weakref.WeakSet()  # drafters whose request in progress a save includes
        self._lock = threading.RLock()
        self._saved_at = time.monotonic()
        self._rebuild(docs)
        if store is not None:
            _AT_EXIT.add(self)

    def _kept(self, doc: Doc) -> Doc | None:
        toks = doc.tokens[-self.max_tokens:] if self.max_tokens else []
        return Doc(doc.id, doc.t, [int(t) for t in toks]) if len(toks) >= 2 else None

    def _rebuild(self, docs: Sequence[Doc]) -> None:
        """The corpus of `docs` (oldest first): the newest that fit the bound, indexed at once."""
        keep, total = [], 0
        for d in reversed([k for k in map(self._kept, docs) if k is not None]):
            if total + len(d.tokens) > self.max_tokens and keep:
                break
            keep.append(d)
            total += len(d.tokens)
        self.docs, self.total = keep[::-1], total
        self.index = flat_index(self.docs)

    def _append(self, doc: Doc) -> None:
        doc = self._kept(doc)
        if doc is None:
            return
        if self.total + len(doc.tokens) > self.max_tokens:
            # oldest first, down to 90% of the bound: one rebuild every tenth of it, not one per request
            docs, total = self.docs + [doc], self.total + len(doc.tokens)
            while total > self.max_tokens * 0.9 and len(docs) > 1:
                total -= len(docs.pop(0).tokens)
            self._rebuild(docs)
            return
        self.docs.append(doc)
        self.total += len(doc.tokens)
        self.index.extend(([SEP] if len(self.index) else []) + doc.tokens)

    def commit(self, doc: Doc) -> None:
        """A finished request joins the corpus (and the next save)."""
        with self._lock:
            self._append(doc)
            self.version += 1
            if self.store is not None:
                self._unsaved[doc.id] = doc
                if time.monotonic() - self._saved_at >= self.save_every_s:
                    self.save()

    def attach(self, drafter: "SuffixDrafter") -> None:
        self._live.add(drafter)

    def save(self) -> None:
        """Write the new docs and the requests in progress to the store (never raises: a cache that cannot be
        written only costs speed; the store says why once)."""
        if self.store is None:
            return
        with self._lock:
            docs = dict(self._unsaved)
            for d in list(self._live):
                live = d.snapshot()
                if live is not None:
                    docs[live.id] = live
            self._saved_at = time.monotonic()
            if docs and self.store.save(list(docs.values())):
                self._unsaved.clear()
            else:  # kept for the next try, as far as the corpus still holds them (a cache dir that stays read-only)
                kept = {d.id for d in self.docs}
                self._unsaved = {i: d for i, d in self._unsaved.items() if i in kept}


class _AtExit:
    """Saves every persisted corpus when the process ends (`localspec run` answers once and exits)."""

    def __init__(self) -> None:
        self.corpora: weakref.WeakSet = weakref.WeakSet()
        self.registered = False

    def add(self, corpus: SuffixCorpus) -> None:
        if not self.registered:
            import atexit

            atexit.register(self.run)
            self.registered = True
        self.corpora.add(corpus)

    def run(self) -> None:
        for c in list(self.corpora):
            c.save()


_AT_EXIT = _AtExit()


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


_CORPORA: dict[tuple[str, str], SuffixCorpus] = {}  # (vocabulary, scope) -> this process's corpus
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loaded model -> its vocabulary's
_PRIVATE: set[str] = set()  # scopes whose corpus starts empty and is never read from or saved to the cache dir
_STATIC: dict[str, NgramIndex | None] = {}  # vocabulary -> its static corpus' index (None: none), read once


def private_scope() -> str:
    """A new scope of its own: its corpus starts empty, is never persisted and is shared with no other scope
    (`bench` measures each run as a lone request on a cold cache, whatever earlier runs answered)."""
    scope = f"private-{uuid.uuid4().hex}"
    _PRIVATE.add(scope)
    return scope


def release_scope(scope: str) -> None:
    """Forget a private scope and its corpora (a drafter still holding one keeps it until it is replaced)."""
    _PRIVATE.discard(scope)
    for key in [key for key in _CORPORA if key[1] == scope]:
        del _CORPORA[key]


def corpus_for(model, scope: str = "") -> SuffixCorpus:
    """This process's corpus for `model`'s vocabulary and `scope` (every engine of the process shares it), read from
    the cache dir on first use unless the setting suffix_cache is off or the scope is private."""
    from localspec.store import suffixcache as SC

    fp = _FINGERPRINTS.get(model)
    if fp is None:
        fp = _FINGERPRINTS[model] = SC.model_fingerprint(model)
    corpus = _CORPORA.get((fp, scope))
    if corpus is None:
        persist, limit = SC.configured()
        store = SC.SuffixFile(fp, scope, limit) if persist and limit > 0 and scope not in _PRIVATE else None
        docs = [Doc(i, t, toks) for i, t, toks in store.load()] if store is not None else []
        static = None if scope in _PRIVATE else static_index(fp)
        corpus = _CORPORA[(fp, scope)] = SuffixCorpus(limit, docs, store, static=static)
    return corpus


def static_index(fp: str) -> NgramIndex | None:
    """The index of the vocabulary's static corpus (store/suffixcache.static_path), read on first use and shared by
    every scope: a folder's text the user chose, not any client's requests. None where there is none."""
    from localspec.store import suffixcache as SC

    if fp not in _STATIC:
        docs = SC.SuffixFile(fp, max_tokens=SC.STATIC_TOKENS, path=SC.static_path(fp)).load()
        _STATIC[fp] = flat_index([Doc(i, t, toks) for i, t, toks in docs]) if docs else None
    return _STATIC[fp]
