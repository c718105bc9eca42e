"""The suffix drafter's corpus: the finished requests of one scope (a process's requests, or those of one API key),
oldest first and bounded, with their index; saved across sessions by store/suffixcache.py (the requests in progress
too, and at the process's end), with the static corpus of a folder's text beside it. One corpus per vocabulary and
scope in a process (`corpus_for`); a private scope (`private_scope`) starts empty and is never persisted.
"""

from __future__ import annotations

import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Sequence

from localspec.drafters.suffix_index import SEP, NgramIndex


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

    def attach(self, drafter) -> None:
        """A drafter (suffix.SuffixDrafter) whose request in progress each save includes (its `snapshot`)."""
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
