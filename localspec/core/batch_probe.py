"""Whether requests decoded together in one llama_decode (core/batch.py) keep one-token decoding's logits: the probe
of the pass shapes a batch makes (probe_batch), and its verdicts, kept in the probes' memo per model file, build and
batch settings (batch_probe_key, read_batch_probe, write_batch_probe)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from localspec.core.probe_memo import BATCH_KEY, CACHE_FILE, model_key
from localspec.store.cachefile import read_json, update_json


def batch_probe_key(model, *settings) -> str:
    """The cache key of a batch probe: the model file, the llama.cpp build and the model's settings (as the
    single-sequence probe's key), and the batch's own settings that decide the verdict (slots, rows, layout)."""
    return BATCH_KEY + model_key(model, 0) + "|" + "|".join(str(x) for x in settings)


def cached_batch_probe(key: str) -> dict | None:
    entry = read_json(CACHE_FILE).get(key)
    return entry if isinstance(entry, dict) and isinstance(entry.get("exact"), bool) else None


def store_batch_probe(key: str, entry: dict) -> None:
    """Add one verdict (under the memo's lock: another process's entries are kept)."""
    update_json(CACHE_FILE, lambda db: db.__setitem__(key, entry))


# ------------------------------------------------------------------ several requests in one pass (core/batch.py)
# Two texts: whether a GEMM row rounds as the GEMV row does depends on the values, so one text can miss a pass shape
# that differs.
BATCH_TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs, then "
              "def f(x): return x + 1")
BATCH_TEXT_ALT = "Rows: 17, 42, 3.5e-2; SELECT name FROM users WHERE id = 9 -- {\"k\": [1, 2]}"
PROBE_HEAD = 6  # probe tokens in every sequence's cache before the rows compared (whether GEMM and GEMV rows
# round alike depends on the values: a probe that decoded its first token again measured equal where others differ)
BATCH_REV = 1  # the batch probe's revision in its cache key: raised when probe_batch checks something new


@dataclass
class ProbeResult:
    """What BatchEngine's probe found. exact: every probed pass shape is bit-identical to one-token decoding.
    shapes: (requests, rows each) -> bit-identical. beside_prompt: requests in the pass -> a prompt chunk beside the
    others' 1-row steps changes no logits. blanket: the verdict holds for every batched request (no pass shape is
    known to be exact)."""

    exact: bool
    why: str
    shapes: dict = field(default_factory=dict)
    beside_prompt: dict = field(default_factory=dict)
    blanket: bool = True

    @property
    def verdict(self) -> tuple[bool, str]:
        return self.exact, self.why


def probe_batch(ms, target, n_slots: int, most: int) -> ProbeResult:
    """Whether requests decoded together in one llama_decode (core/batch.py) keep one-token decoding's logits.
    Decode the shapes the batch really makes (llama.cpp runs a batch as passes of consecutive sequences with
    equal rows each, see multiseq.split_equal) and compare every row bit for bit with one-token decoding: every
    n <= n_slots sequences x every r <= bit_rows() rows each in one pass; a prompt chunk beside other requests'
    rows (its last row and the cache it leaves); another request's rollbacks beside a sequence. `ms`: the batch's
    MultiSeq over `target`; most: the rows a bit request verifies (the bit k cap + 1)."""
    if n_slots < 2:
        return ProbeResult(True, "one slot: nothing else shares its batches")
    if ms.unified:
        return ProbeResult(False, "all requests share one KV cache (LOCALSPEC_KV_UNIFIED=1): after other "
                           "requests' rollbacks a request's cache cells are no longer in position order, and "
                           "attention sums them in cell order")
    n = n_slots
    # whether a GEMM row rounds as the GEMV row does depends on the values: every check runs on two texts
    texts = []
    for source in (BATCH_TEXT, BATCH_TEXT_ALT):
        got = [t for t in target.tokenize(source, add_special=False) if 0 <= t < target.n_vocab]
        if got or not texts:
            got = got or [1, 2, 3, 4]
            texts.append([got[i % len(got)] for i in range(PROBE_HEAD + most)])
    toks, head = texts[0][:PROBE_HEAD], PROBE_HEAD
    try:
        # one-token decoding here, alone: the reference for every row below
        refs = [one_token_rows(ms, ex) for ex in texts]
        target.clear()
        for t in toks:
            one = target.decode([t], "last")[0]
        target.clear()
        if not np.array_equal(one, refs[0][head - 1]):
            return ProbeResult(False, "one-token decoding in the batch context differs from the target's own "
                               "context")
        # every pass shape a bit request can be in: s sequences x r rows each, all rows' logits wanted (on the
        # second text, only the shapes of several requests that the first found bit-identical)
        shapes: dict[tuple[int, int], bool] = {}
        for ex, rf in zip(texts, refs):
            ms.clear()
            for s in range(n):
                for t in ex[:head]:
                    ms.decode([(s, [t], [])])
            for s in range(1, n + 1):
                for r in range(1, most + 1):
                    if s * r > ms.n_batch or ((s, r) in shapes and (s < 2 or not shapes[(s, r)])):
                        continue
                    outs = ms.decode([(j, ex[head:head + r], range(r)) for j in range(s)])
                    shapes[(s, r)] = all(np.array_equal(o[i], rf[head + i]) for o in outs for i in range(r))
                    for j in range(s):
                        ms.truncate(j, head)
        # a prompt decoded beside s - 1 other requests' pending rows: its last row (the first token's logits)
        # equals the target's own prefill, the rows beside it their references, and the cache it leaves
        # decodes on alike
        beside: dict[int, bool] = {s: True for s in range(2, n + 1)}
        for ex, rf in zip(texts, refs):
            tk = ex[:head]
            target.clear()
            own = target.decode(tk, "last")[0].copy()
            after = target.decode(ex[head:head + 1], "last")[0].copy()
            target.clear()
            ms.clear()
            for j in range(1, n):
                for t in tk:
                    ms.decode([(j, [t], [])])
            for s in range(2, n + 1):
                ms.clear(0)
                outs = ms.decode([(0, tk, [head - 1])] + [(j, ex[head:head + 1], [0]) for j in range(1, s)])
                ok = np.array_equal(outs[0][0], own) and all(np.array_equal(o[0], rf[head]) for o in outs[1:])
                ok = ok and np.array_equal(ms.decode([(0, ex[head:head + 1], [0])])[0][0], after)
                beside[s] = beside[s] and ok
                for j in range(1, s):
                    ms.truncate(j, head)
        spans = probe_lengths(ms, toks)
        rolled = spans and _probe_rollbacks(ms, toks)
    finally:
        ms.clear()
    if not spans:
        return ProbeResult(False, "a row's logits change with the cache length of another request in its pass "
                           "(flash attention spans the longest cache of the pass; with BF16 KV on CPUs with "
                           "AVX512-BF16 the extra masked cells change the sums)")
    if not rolled:
        return ProbeResult(False, "a row's logits change when other requests' rolled-back drafts leave its cache "
                           "cells out of position order")
    bad = [f"{s} x {r}" for (s, r), ok in sorted(shapes.items(), key=lambda x: (x[0][0] * x[0][1], x[0]))
           if not ok and s > 1]
    if not bad and all(beside.values()):
        return ProbeResult(True, f"a row's logits are bit-identical with up to {n} requests x {most} rows in its "
                           "forward pass, beside another request's prompt chunk and its rollbacks", shapes, beside)
    what = []
    if bad:
        what.append("passes of " + ", ".join(bad[:6]) + (" ..." if len(bad) > 6 else "") +
                    " rows (requests x rows each) are not bit-identical to one-token decoding")
    if not all(beside.values()):
        what.append("a prompt chunk decoded beside " + ", ".join(f"{s - 1}" for s, ok in beside.items() if not ok)
                    + " other requests' rows changes its or their logits")
    return ProbeResult(False, "; ".join(what), shapes, beside, blanket=False)

def _probe_rollbacks(ms, toks: list[int]) -> bool:
    """Another request's rejected rows rolled back beside a sequence between its steps leave its logits alone."""
    long = (toks * 2)[:10]
    refs = one_token_rows(ms, long)
    ms.decode([(1, [toks[0]], [])])
    for i, t in enumerate(long):
        got = ms.decode([(1, [toks[1]] * 3, []), (0, [t], [0])])[1][0]
        if not np.array_equal(got, refs[i]):
            return False
        ms.truncate(1, len(ms.tokens[1]) - 2)  # the other request rejects two of its three rows
    return True


def one_token_rows(ms, tokens: list[int]) -> list[np.ndarray]:
    """Sequence 0's logits for each of `tokens`, decoded one a step from an empty cache: the probes' reference.
    Every cache is empty again afterwards."""
    ms.clear()
    rows = [np.array(ms.decode([(0, [t], [0])])[0][0], copy=True) for t in tokens]
    ms.clear()
    return rows


def probe_lengths(ms, toks: list[int], steps: int = 12) -> bool:
    """Whether sequence 0's logits, decoded one token a step beside sequence 1 (one row a step, its cache
    `len(toks) // 2 + 1` tokens longer: requests started at different times, every pass of a running batch), equal
    its one-token decoding alone, over `steps` steps."""
    long = (toks * (steps // max(len(toks), 1) + 1))[:steps]
    refs = one_token_rows(ms, long)
    try:
        for t in toks[: len(toks) // 2 + 1]:
            ms.decode([(1, [t], [])])
        for i, t in enumerate(long):
            got = ms.decode([(1, [toks[i % len(toks)]], []), (0, [t], [0])])[1][0]
            if not np.array_equal(got, refs[i]):
                return False
        return True
    finally:
        ms.clear()


def read_batch_probe(key: str) -> ProbeResult | None:
    """The cached verdict of probe_batch under `key` (None: not cached, or an entry edited by hand)."""
    entry = cached_batch_probe(key)
    if entry is None:
        return None
    try:
        return ProbeResult(entry["exact"], str(entry.get("why", "")),
                           {(int(s), int(r)): bool(ok) for s, r, ok in entry.get("shapes", [])},
                           {int(s): bool(ok) for s, ok in entry.get("beside_prompt", [])},
                           bool(entry.get("blanket", True)))
    except (TypeError, ValueError):  # probed again and replaced
        return None


def write_batch_probe(key: str, res: ProbeResult, model, slots: int) -> None:
    store_batch_probe(key, {
        "exact": res.exact, "why": res.why, "blanket": res.blanket,
        "shapes": [[s, r, ok] for (s, r), ok in sorted(res.shapes.items())],
        "beside_prompt": [[s, ok] for s, ok in sorted(res.beside_prompt.items())],
        "model": str(model.path.resolve()), "slots": slots})
