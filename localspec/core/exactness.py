"""How large may a verify batch be while every row's logits stay bit-identical to one-token decoding, and how far
do the rows of bigger batches move?

llama.cpp switches matmul kernels with the batch size (on CPUs that repack Q4_K weights, from 4 rows; on CUDA and
Metal from 2 rows; docs/design.md, "Exactness", has the figures), so a verify batch can change greedy choices at
small margins. The probe measures, once per model file and build, the largest
exact batch (bit exactness caps k below it) and, per batch size, the largest |logit difference| between a batched
row and the one-token decode of the same position (the divergence audit in `localspec bench` compares a
divergence's top-2 margin with it).

Recurrent/hybrid models (llama/model.py rollback kinds rs/checkpoint) are probed the same way: the state after the
prefix is saved as a checkpoint, so every `truncate` back to it restores it instead of relying on a full-batch
`seq_rm` (which recurrent state cannot do). A probe can be cancelled between decodes (a threading.Event).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from localspec.core.policy import LIVE_KEPT, LIVE_KEPT_BAND, LIVE_MIN, LIVE_SCALE
from localspec.knobs import knobs
from localspec.store.cachefile import read_json, update_json, write_json

PROBE_TEXT = "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n" * 3
LONG_CONTEXT = 600  # past 512 KV cells, where llama.cpp's CPU attention changes strategy
CACHE_FILE = "exact_batch.json"
PROBE_MIN_UPTO = 9  # the engine probes batches up to at least this (k = 8) once, and derives smaller caps from it


class ProbeCancelled(Exception):
    """The probe's cancel event was set; nothing was cached."""


def _check(cancel) -> None:
    if cancel is not None and cancel.is_set():
        raise ProbeCancelled()


def _mark(model) -> None:
    """The prefix is decoded: a recurrent/hybrid model saves its state here, so truncating back restores it."""
    save = getattr(model, "save_checkpoint", None)
    if save is not None:
        save()


def _long_ok(model, upto: int) -> bool:
    return model.n_ctx >= LONG_CONTEXT + upto + 8


def _build() -> str:
    """The llama.cpp build and the CPU it runs on (llama/sysinfo.build_id): a key part of every probe."""
    from localspec.llama.sysinfo import build_id

    return build_id()


def _file_version(path) -> str:
    """A model file as it is now: its resolved path, size and modification time (the start of every cache key, so a
    file replaced at the same path is measured anew)."""
    st = Path(path).stat()
    return f"{Path(path).resolve()}|{st.st_size}|{st.st_mtime_ns}"


def _key(model, upto: int) -> str:
    parts = [_file_version(model.path), model.n_threads, model.n_gpu_layers,
             _build(), "1" if knobs().no_repack else "", model.kv_type,
             _long_ok(model, upto), upto]
    if getattr(model, "rpc_servers", None):  # the workers compute the layers: their kernels decide
        parts += ["rpc=" + ",".join(model.rpc_servers), "split=" + str(getattr(model, "tensor_split", None))]
    return "|".join(str(x) for x in parts)


def measure(model, upto: int, cancel=None) -> dict:
    """{"batch": largest B <= upto such that batches of 1..B rows are bit-identical to one-token decodes,
    "deviation": {B: largest |Δlogit| of any row of a B-row batch vs its one-token decode}}, over a short and
    (when the context allows) a long prefix."""
    best, dev = _measure_at(model, upto, 8, cancel)
    if _long_ok(model, upto):
        best_long, dev_long = _measure_at(model, upto, LONG_CONTEXT, cancel)
        best = min(best, best_long)
        dev = {b: max(v, dev_long[b]) for b, v in dev.items()}
    return {"batch": best, "deviation": dev}


def probe(model, upto: int) -> int:
    """Largest B <= upto such that batches of 1..B rows are bit-identical to one-token decodes (uncached)."""
    return measure(model, upto)["batch"]


def _measure_at(model, upto: int, prefix: int, cancel=None) -> tuple[int, dict[int, float]]:
    saved = list(model.tokens)
    model.clear()
    try:
        ids = model.tokenize(PROBE_TEXT)
        while len(ids) < prefix + upto + 8:
            ids = ids + ids[1:]
        ctx, seq = ids[:prefix], ids[prefix : prefix + upto]
        model.decode(ctx)
        base = len(model.tokens)
        _mark(model)
        singles = []
        for t in seq:
            _check(cancel)
            singles.append(model.decode([t], "last")[0])
        model.truncate(base)
        best, exact, dev = 1, True, {}
        for b in range(2, len(seq) + 1):
            _check(cancel)
            rows = model.decode(seq[:b], "all")
            model.truncate(base)
            exact = exact and all(np.array_equal(rows[i], singles[i]) for i in range(b))
            if exact:
                best = b
            dev[b] = float(max(np.max(np.abs(rows[i] - singles[i])) for i in range(b)))
        return best, dev
    finally:
        model.clear()
        if saved:
            model.decode(saved, "last")


def _record(model, upto: int, cancel=None) -> dict:
    """The cached measurement for this model, build and settings; measured on a miss (or an entry from an older
    localspec that stored only the batch)."""
    from localspec.llama.sysinfo import llama_cpp_version
    key = _key(model, upto)
    db = read_json(CACHE_FILE)
    entry = db.get(key)
    if isinstance(entry, dict) and "batch" in entry and isinstance(entry.get("deviation"), dict):
        return entry
    m = measure(model, upto, cancel) if cancel is not None else measure(model, upto)
    entry = {
        "batch": m["batch"],
        "deviation": {str(b): v for b, v in m["deviation"].items()},
        "model": str(model.path.resolve()),
        "upto": upto,
        "threads": model.n_threads,
        "gpu_layers": model.n_gpu_layers,
        "kv_type": model.kv_type,
        "long_prefix": _long_ok(model, upto),
        "llama_cpp": llama_cpp_version(),
    }
    db = read_json(CACHE_FILE)  # re-read: another process may have added entries meanwhile
    db[key] = entry
    write_json(CACHE_FILE, db)
    return entry


def max_exact_batch(model, upto: int, cancel=None) -> int:
    """The probe's answer, cached per model file, build, threads, GPU layers and KV type. (LOCALSPEC_ALLOW_INEXACT
    is handled by the engine: it selects lossless exactness.) `cancel`: a threading.Event that stops the probe
    between decodes (ProbeCancelled)."""
    return int(_record(model, upto, cancel)["batch"])


def deviation(model, upto: int) -> dict[int, float]:
    """Per batch size B in 2..upto: the largest |Δlogit| between a row of a B-row batch and the one-token decode
    of the same position (0.0 where bit-identical). Cached with the exact batch."""
    return {int(b): float(v) for b, v in _record(model, upto)["deviation"].items()}


def cached_probes() -> list[dict]:
    """Every cached probe, for `localspec doctor`: model, settings, exact batch and deviation per batch size, and
    whether it is the current file's on this build (`current`)."""
    out, build = [], _build()
    for key, entry in read_json(CACHE_FILE).items():
        if isinstance(entry, dict) and "batch" in entry and not key.startswith(("cost|", COST_KEY, BATCH_KEY)):
            out.append({**entry, "deviation": {int(b): float(v) for b, v in (entry.get("deviation") or {}).items()},
                        "current": _current(key, entry, build)})
    return out


def _current(key: str, entry: dict, build: str) -> bool:
    """Whether a cached entry is the one the model file as it is now, on this llama.cpp build, would be looked up by
    (for some threads, GPU layers and KV type): a file replaced at the same path, or a cache dir shared with another
    machine or build, leaves entries that are never used here again."""
    try:
        version = _file_version(entry.get("model"))
    except (OSError, TypeError, ValueError):
        return False
    return f"{version}|" in key and f"|{build}|" in key


# ------------------------------------------------------------------ what a verify batch costs here
COST_MIN_UPTO = 9  # measured at least up to this batch (k = 8), so most k changes need no new measurement
COST_REPS = 5
COST_KEY = "cost2|"  # cost|: timed one size after the other (time_batches' docstring), measured again


# b one-token decodes compute the same rows as one batch of b rows, so the batch never costs more: a calibration that
# reads more was disturbed (another process took the cores while it timed; one such read 2 rows at 5.0 one-token
# decodes, and cached, it priced every verify out: `auto` never drafted on that model again). It is measured again.
COST_SLACK = 0.05  # T(b)/T(1) above b x (1 + this) is disturbed (a quiet machine's medians move by a few percent)
COST_TRIES = 3  # measurements at most, one after the other, until one is undisturbed
COST_RETRY_S = 600  # where every try was disturbed, the least disturbed is used clipped to b for this long, then
#                     measured again (a machine that stays busy pays the measurement at most this often)


def _now() -> float:
    return time.time()


def _excess(ratio: dict[int, float]) -> float:
    """How far the calibration reads above the bound T(b)/T(1) <= b: its largest T(b)/T(1)/b (1.0 at the bound)."""
    return max((v / b for b, v in ratio.items() if b > 1), default=0.0)


def _disturbed(ratio: dict[int, float]) -> bool:
    return _excess(ratio) > 1.0 + COST_SLACK


def _calibrate(model, upto: int) -> tuple[dict[int, float], bool]:
    """T(b)/T(1) for b in 1..upto, measured again while disturbed (up to COST_TRIES times): (ratio, disturbed);
    where every try was disturbed, the least disturbed one clipped to the bound."""
    tries = []
    for _ in range(COST_TRIES):
        ratio = _measure_costs(model, upto)
        if not _disturbed(ratio):
            return ratio, False
        tries.append(ratio)
    least = min(tries, key=_excess)
    return {b: min(v, float(b)) for b, v in least.items()}, True


def _cached_ratio(entry, upto: int) -> dict[int, float] | None:
    """A cached calibration's T(b)/T(1) where it answers for batches up to `upto` (else None): measured far enough, not
    disturbed (one cached before the check existed is measured again), or disturbed and clipped less than
    COST_RETRY_S ago."""
    if not (isinstance(entry, dict) and isinstance(entry.get("ratio"), dict) and len(entry["ratio"]) >= upto):
        return None
    try:
        ratio = {int(b): float(v) for b, v in entry["ratio"].items()}
    except (TypeError, ValueError):
        return None
    at = entry.get("disturbed_at")
    if at is not None:
        fresh = isinstance(at, (int, float)) and 0 <= _now() - at < COST_RETRY_S
        return ratio if fresh else None
    return None if _disturbed(ratio) else ratio


def time_batches(model, upto: int, reps: int = COST_REPS, cancel=None) -> dict[int, float]:
    """Seconds per decode of b rows (all logits, as a verify pass) for b in 1..upto, the median of `reps` timed
    decodes after a 64-token prefix; the model's cache is restored afterwards. Also bench's same-run curve.

    The sizes are timed in interleaved sweeps (1..upto, then upto..1, ...) after one untimed sweep, so a machine
    that slows down or speeds up while it measures shifts every size alike; timed one size after the other, a slow
    first second makes the larger sizes look cheaper than they are, and the controller then drafts where it loses."""
    saved = list(model.tokens)
    model.clear()
    try:
        ids = model.tokenize(PROBE_TEXT)
        while len(ids) < 64 + upto:
            ids = ids + ids[1:]
        model.decode(ids[:64])
        base = len(model.tokens)
        _mark(model)
        sizes = list(range(1, upto + 1))
        ts: dict[int, list[float]] = {b: [] for b in sizes}
        for sweep in range(reps + 1):
            for b in sizes if sweep % 2 == 0 else sizes[::-1]:
                _check(cancel)
                t0 = time.perf_counter()
                model.decode(ids[64 : 64 + b], "all")
                dt = time.perf_counter() - t0
                model.truncate(base)
                if sweep:  # the first sweep warms the kernels and buffers up for every size
                    ts[b].append(dt)
        return {b: statistics.median(v) for b, v in ts.items()}
    finally:
        model.clear()
        if saved:
            model.decode(saved, "last")


def _measure_costs(model, upto: int) -> dict[int, float]:
    """T(b) / T(1) for b in 1..upto."""
    t = time_batches(model, upto)
    return {b: v / t[1] for b, v in t.items()}


def verify_costs(model, upto: int) -> dict[int, float]:
    """What a verify batch of b rows costs in one-token decodes, for b in 1..max(upto, COST_MIN_UPTO), measured once
    per model file, build, threads, GPU layers and KV type (cached beside the probe), its extra cost T(b)/T(1) - 1
    scaled by what generations on this machine measured since (note_verify_steps). The adaptive controller
    starts from it instead of a guessed slope, since the curve is not linear (where ggml repacks weights, 4 rows can
    cost less than 3; on a GPU 9 rows cost about one)."""
    upto = max(upto, COST_MIN_UPTO)
    key = COST_KEY + _key(model, 0)
    entry = read_json(CACHE_FILE).get(key)
    ratio = _cached_ratio(entry, upto)
    if ratio is None:
        ratio, disturbed = _calibrate(model, upto)
        entry = {"ratio": {str(b): v for b, v in ratio.items()}, "model": str(model.path.resolve()),
                 "threads": model.n_threads, "gpu_layers": model.n_gpu_layers}
        if disturbed:
            entry["disturbed_at"] = _now()
        update_json(CACHE_FILE, lambda db: db.__setitem__(key, entry))
    return _scaled(ratio, _scale_of(entry))


def _scale_of(entry: dict) -> float:
    s = entry.get("scale", 1.0)
    return float(s) if isinstance(s, (int, float)) and LIVE_SCALE[0] <= s <= LIVE_SCALE[1] else 1.0


def _scaled(ratio: dict[int, float], scale: float) -> dict[int, float]:
    return {b: 1.0 + (v - 1.0) * scale for b, v in ratio.items()}


def note_verify_steps(model, judgements: list[float], used_scale: float) -> float | None:
    """Keep a generation's live judgements of the calibrated curve (policy.VerifyCurve.live: each verify step's
    extra cost relative to the curve it was priced by, which had `used_scale` applied) with the calibration, the
    latest LIVE_KEPT of them; the calibration's scale follows their median when it leaves the scale by more than
    LIVE_KEPT_BAND, so the next run starts from what this machine did, not from one measurement. Returns the scale
    now stored (None: no calibration to judge)."""
    key = COST_KEY + _key(model, 0)
    out: list[float | None] = [None]

    def fold(db: dict) -> None:
        entry = db.get(key)
        if not isinstance(entry, dict) or not isinstance(entry.get("ratio"), dict):
            return
        scale = _scale_of(entry)
        kept = [float(g) for g in entry.get("live", []) if isinstance(g, (int, float))]
        kept = (kept + [g * used_scale for g in judgements])[-LIVE_KEPT:]
        entry["live"] = kept
        if len(kept) >= LIVE_MIN:
            m = statistics.median(kept)
            if abs(m / scale - 1.0) > LIVE_KEPT_BAND:
                scale = min(max(m, LIVE_SCALE[0]), LIVE_SCALE[1])
        entry["scale"] = out[0] = scale

    update_json(CACHE_FILE, fold)
    return out[0]


def cost_scale(model) -> float:
    """The scale the live verify steps put on the model's cached calibration (1.0 where none)."""
    entry = read_json(CACHE_FILE).get(COST_KEY + _key(model, 0))
    return _scale_of(entry) if isinstance(entry, dict) else 1.0


def verify_costs_cached(model, upto: int) -> bool:
    """Whether verify_costs(model, upto) is answered from the cache (no measuring)."""
    return _cached_ratio(read_json(CACHE_FILE).get(COST_KEY + _key(model, 0)), max(upto, COST_MIN_UPTO)) is not None


def cached_costs() -> list[dict]:
    """Every cached verify-cost calibration, for `localspec doctor`: model, threads, GPU layers, T(b)/T(1) per b as
    the controller prices it (verify_costs) and as measured, the scale the live verify steps put on it and how many
    of them are kept, and whether it is the current file's on this build (`current`)."""
    out, build = [], _build()
    for key, entry in read_json(CACHE_FILE).items():
        if key.startswith(COST_KEY) and isinstance(entry, dict) and isinstance(entry.get("ratio"), dict):
            measured = {int(b): float(v) for b, v in entry["ratio"].items()}
            live = entry.get("live")
            out.append({"model": entry.get("model"), "threads": entry.get("threads"), "gpu_layers": entry.get("gpu_layers"),
                        "ratio": _scaled(measured, _scale_of(entry)), "measured": measured, "scale": _scale_of(entry),
                        "live_steps": len(live) if isinstance(live, list) else 0, "current": _current(key, entry, build),
                        "disturbed": entry.get("disturbed_at") is not None or _disturbed(measured)})
    return out


# ------------------------------------------------------------------ the batch exactness probe's verdicts
BATCH_KEY = "batch|"  # core/batch.py's probe of several requests in one pass, beside the single-sequence probes


def batch_probe_key(model, *settings) -> str:
    """The cache key of a batch probe: the model file, the llama.cpp build and the model's settings (as the
    single-sequence probe's key), and the batch's own settings that decide the verdict (slots, rows, layout)."""
    return BATCH_KEY + _key(model, 0) + "|" + "|".join(str(x) for x in settings)


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
