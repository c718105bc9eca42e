"""What a verify batch of b rows costs on this machine, in one-token decodes: T(b)/T(1), timed once per model file,
build, threads, GPU layers and KV type and kept in the probes' memo (verify_costs), timed again where a busy machine
disturbed it, and scaled by what the verify steps of later generations paid (note_verify_steps). The adaptive
controller prices k on it (core/pricing.py), a batch prices its steps on it (core/batch_cost.py), `localspec doctor`
lists it (cached_costs) and `localspec bench` times its same-run curve with time_batches."""

from __future__ import annotations

import statistics
import time

from localspec.core.exactness import PROBE_TEXT, check_cancel, mark_prefix
from localspec.core.pricing import LIVE_MIN, LIVE_SCALE
from localspec.core.probe_memo import CACHE_FILE, COST_KEY, is_current, model_key, this_build
from localspec.store.cachefile import read_json, update_json

COST_MIN_UPTO = 9  # measured at least up to this batch (k = 8), so most k changes need no new measurement
COST_REPS = 5

# Kept with the calibration across runs, the judgements are many: their median moves by 2-3% from answer to answer on
# timing noise, so the stored scale follows it within a narrow band. A 20% band (the in-run one) held a stored scale
# of 1.53 over judgements whose median was 1.30: wherever one slow stretch had put it, for good.
LIVE_KEPT = 96  # the latest judgements kept with the calibration
LIVE_KEPT_BAND = 0.05  # the stored scale moves when their median leaves it by more than this


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
        mark_prefix(model)
        sizes = list(range(1, upto + 1))
        ts: dict[int, list[float]] = {b: [] for b in sizes}
        for sweep in range(reps + 1):
            for b in sizes if sweep % 2 == 0 else sizes[::-1]:
                check_cancel(cancel)
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
    key = COST_KEY + model_key(model, 0)
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
    """Keep a generation's live judgements of the calibrated curve (pricing.VerifyCurve.live: each verify step's
    extra cost relative to the curve it was priced by, which had `used_scale` applied) with the calibration, the
    latest LIVE_KEPT of them; the calibration's scale follows their median when it leaves the scale by more than
    LIVE_KEPT_BAND, so the next run starts from what this machine did, not from one measurement. Returns the scale
    now stored (None: no calibration to judge)."""
    key = COST_KEY + model_key(model, 0)
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
    entry = read_json(CACHE_FILE).get(COST_KEY + model_key(model, 0))
    return _scale_of(entry) if isinstance(entry, dict) else 1.0


def verify_costs_cached(model, upto: int) -> bool:
    """Whether verify_costs(model, upto) is answered from the cache (no measuring)."""
    return _cached_ratio(read_json(CACHE_FILE).get(COST_KEY + model_key(model, 0)), max(upto, COST_MIN_UPTO)) is not None


def cached_costs() -> list[dict]:
    """Every cached verify-cost calibration, for `localspec doctor`: model, threads, GPU layers, T(b)/T(1) per b as
    the controller prices it (verify_costs) and as measured, the scale the live verify steps put on it and how many
    of them are kept, and whether it is the current file's on this build (`current`)."""
    out, build = [], this_build()
    for key, entry in read_json(CACHE_FILE).items():
        if key.startswith(COST_KEY) and isinstance(entry, dict) and isinstance(entry.get("ratio"), dict):
            measured = {int(b): float(v) for b, v in entry["ratio"].items()}
            live = entry.get("live")
            out.append({"model": entry.get("model"), "threads": entry.get("threads"), "gpu_layers": entry.get("gpu_layers"),
                        "ratio": _scaled(measured, _scale_of(entry)), "measured": measured, "scale": _scale_of(entry),
                        "live_steps": len(live) if isinstance(live, list) else 0, "current": is_current(key, entry, build),
                        "disturbed": entry.get("disturbed_at") is not None or _disturbed(measured)})
    return out
