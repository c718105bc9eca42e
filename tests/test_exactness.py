"""The verify-cost calibration that the adaptive controller starts from."""

import threading

import pytest


def test_verify_costs_are_measured_once_and_cached(target_path, tmp_path, monkeypatch):
    from localspec.core import exactness as X
    from localspec.core import verify_cost as V
    from localspec.llama.model import Model
    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "cache"))
    with Model(target_path, n_ctx=512) as m:
        r = V.verify_costs(m, 5)
        assert sorted(r) == list(range(1, V.COST_MIN_UPTO + 1)) and r[1] == 1.0
        assert all(v > 0 for v in r.values())
        monkeypatch.setattr(V, "_measure_costs", lambda *a: pytest.fail("measured again"))
        assert V.verify_costs(m, 9) == r  # cached
        assert not [p for p in X.cached_probes() if "ratio" in p]  # doctor's probe list is not confused by it


def test_the_engine_reads_the_calibration_once(target_path, tmp_path, monkeypatch):
    """make_policy runs for every answer: the calibration is read from the cache file once per engine, not each time."""
    from localspec.core import verify_cost as V
    from localspec.core.engine import Engine, GenConfig
    from localspec.core.policy import repeat_k

    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real = V.verify_costs
    monkeypatch.setattr(V, "verify_costs", lambda m, upto: calls.append(upto) or real(m, upto))
    e = Engine.load(target_path, n_ctx=512)
    try:
        for _ in range(3):
            e.complete(e.raw_prompt("the cat"), GenConfig(method="lookup", k=3, max_tokens=4, adaptive=True))
    finally:
        e.close()
    assert calls == [repeat_k(3) + 1]  # the curve up to the widest verify a step may use (a repeat's)


def test_one_exactness_probe_per_model(target_path, monkeypatch):
    """The probe runs once (batches up to max(k + 1, 9)); smaller k are derived from it, a larger
    k re-probes once."""
    import localspec.core.exactness as ex
    from localspec.core.engine import Engine, GenConfig

    calls = []
    monkeypatch.setattr(ex, "max_exact_batch", lambda model, upto, **kw: calls.append(upto) or min(4, upto))
    e = Engine.load(target_path, None, n_ctx=512, threads=1)
    try:
        assert e.exact_k(8) == 3 and calls == [9]
        assert e.exact_k(2) == 2 and e.exact_k(5) == 3 and e.exact_k(1) == 1 and calls == [9]
        assert e.exact_k(12) == 3 and calls == [9, 13]
        assert e.exact_k(6) == 3 and calls == [9, 13]
    finally:
        e.close()


def test_the_probe_is_cancellable(target_path, tmp_path, monkeypatch):
    """A set cancel event stops the probe between decodes: nothing is cached, the generation ends "cancelled"."""
    import localspec.core.exactness as ex
    from localspec.core import probe_memo as M
    from localspec.core.engine import Engine, GenConfig

    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path))
    decodes = []
    ev = threading.Event()
    e = Engine.load(target_path, None, n_ctx=512, threads=1)
    try:
        real = e.target.decode

        def counting(*a, **kw):
            decodes.append(1)
            if len(decodes) == 3:
                ev.set()  # the user gives up while the probe runs
            return real(*a, **kw)

        monkeypatch.setattr(e.target, "decode", counting)
        with pytest.raises(ex.ProbeCancelled):
            ex.max_exact_batch(e.target, 9, cancel=ev)
        assert len(decodes) < 6 and not (tmp_path / M.CACHE_FILE).exists()
        decodes.clear()
        ev.clear()
        fin = None
        for item in e.generate(e.raw_prompt("the cat"), GenConfig(method="lookup", k=8, max_tokens=20,
                                                                  exactness="bit"), cancel=ev):
            fin = item
        assert fin.finish_reason == "cancelled" and fin.stats.drafted == 0
        assert e._probe is None  # not cached: the next request probes
    finally:
        e.close()


def test_the_calibration_is_not_skewed_by_a_slow_first_moment(monkeypatch):
    """Batch sizes timed one after the other would let a slow first second (a busy neighbour, kernels warming up)
    inflate only the small batches, and the ratio of everything else to them would come out low (on a 2-core AMD
    EPYC: 5-9 rows at 2.5-4.2 one-token decodes where they cost 3.4-5.0), a figure the controller keeps and drafts
    on. On a fake clock whose first 15 decodes run 1.5x slower, the ratios must come out right."""
    from types import SimpleNamespace

    from localspec.core import verify_cost as V

    cost = {b: 1.0 + 0.5 * (b - 1) for b in range(1, 65)}  # the machine's true T(b)/T(1)
    clock = [0.0]

    class Drifting:
        def __init__(self):
            self.tokens, self.decodes = [], 0

        def clear(self):
            self.tokens = []

        def tokenize(self, text):
            return list(range(100))

        def decode(self, ids, logits="last"):
            self.decodes += 1
            clock[0] += cost[min(len(ids), 64)] * (1.5 if self.decodes <= 15 else 1.0)
            self.tokens += list(ids)

        def truncate(self, n):
            self.tokens = self.tokens[:n]

    monkeypatch.setattr(V, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    ratio = V._measure_costs(Drifting(), 9)
    assert ratio == pytest.approx({b: cost[b] for b in range(1, 10)}, rel=0.02)


def test_a_calibration_taken_on_a_busy_machine_is_measured_again(target_path, tmp_path, monkeypatch):
    """b one-token decodes compute the same rows as one batch of b, so a batch never costs more than b of them; a
    calibration that reads more (2 rows at 5.0 one-token decodes, measured while another process took the cores)
    was disturbed. Cached as it was, it priced every verify out for good and `auto` never drafted again on that model.
    It is measured again (up to COST_TRIES times); one cached from before is measured again when read; where every try
    was disturbed, the least disturbed one is used clipped to b, and measured again once COST_RETRY_S have passed."""
    from localspec.core import probe_memo as M
    from localspec.core import verify_cost as V
    from localspec.llama.model import Model
    from localspec.store.cachefile import read_json, update_json

    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "cache"))
    busy = {1: 1.0, 2: 5.01, 3: 7.79, 4: 6.63, 5: 9.88, 6: 6.95, 7: 12.19, 8: 17.7, 9: 12.46}  # read on a busy machine
    busier = {b: 2 * v for b, v in busy.items() if b > 1} | {1: 1.0}
    quiet = {b: 1.0 + 0.6 * (b - 1) for b in range(1, 10)}
    now = [1000.0]
    monkeypatch.setattr(V, "_now", lambda: now[0])
    with Model(target_path, n_ctx=512) as m:
        readings = [dict(busy), dict(quiet)]
        monkeypatch.setattr(V, "_measure_costs", lambda mm, upto: readings.pop(0))
        assert V.verify_costs(m, 9) == quiet and not readings  # the busy reading was measured again at once

        key = next(k for k in read_json(M.CACHE_FILE) if k.startswith(M.COST_KEY))
        update_json(M.CACHE_FILE, lambda db: db[key].update(ratio={str(b): v for b, v in busy.items()}))
        readings = [dict(quiet)]
        assert V.verify_costs(m, 9) == quiet and not readings  # cached from before: measured again when read

        update_json(M.CACHE_FILE, lambda db: db.pop(key))
        readings = [dict(busier)] + [dict(busy)] * (V.COST_TRIES - 1)
        clipped = V.verify_costs(m, 9)
        assert not readings and clipped == {b: min(v, b) for b, v in busy.items()}  # the least disturbed, clipped
        assert [c["disturbed"] for c in V.cached_costs()] == [True]
        from helpers import cli

        r = cli(["doctor"], env={"LOCALSPEC_CACHE_DIR": str(tmp_path / "cache")}, timeout=120)
        assert "taken while the machine was busy" in r.stdout.decode(), r.stdout.decode()
        monkeypatch.setattr(V, "_measure_costs", lambda *a: pytest.fail("measured again within COST_RETRY_S"))
        now[0] += V.COST_RETRY_S - 1
        assert V.verify_costs(m, 9) == clipped and V.verify_costs_cached(m, 9)
        now[0] += 2
        assert not V.verify_costs_cached(m, 9)
        monkeypatch.setattr(V, "_measure_costs", lambda mm, upto: dict(quiet))
        assert V.verify_costs(m, 9) == quiet and [c["disturbed"] for c in V.cached_costs()] == [False]


def test_the_run_s_verify_steps_rescale_the_cached_calibration(target_path, tmp_path, monkeypatch):
    """One calibration, taken in a few seconds, read 1.55 one-token decodes for 2 rows where the same machine's
    verify steps then cost 1.7-1.8: each generation's judgements of the curve are kept with it (the latest
    LIVE_KEPT), and its extra cost T(b)/T(1) - 1 is scaled by their median once they are LIVE_MIN and leave the
    scale by more than LIVE_KEPT_BAND. The next run, and doctor, price by the scaled curve; a damaged record is ignored."""
    from localspec.core import probe_memo as M
    from localspec.core import verify_cost as V
    from localspec.core.pricing import LIVE_MIN
    from localspec.core.verify_cost import LIVE_KEPT
    from localspec.llama.model import Model
    from localspec.store.cachefile import read_json, write_json

    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "cache"))
    measured = {b: 1.0 + 0.5 * (b - 1) for b in range(1, 10)}
    monkeypatch.setattr(V, "_measure_costs", lambda m, upto: dict(measured))
    with Model(target_path, n_ctx=512) as m:
        assert V.verify_costs(m, 9) == measured and V.cost_scale(m) == 1.0
        assert V.note_verify_steps(m, [1.4] * (LIVE_MIN - 1), 1.0) == 1.0  # too few yet
        assert V.verify_costs(m, 9) == measured
        assert V.note_verify_steps(m, [1.4], 1.0) == pytest.approx(1.4)
        scaled = V.verify_costs(m, 9)
        assert scaled[3] == pytest.approx(1.0 + 1.0 * 1.4) and scaled[1] == 1.0
        # judgements made against the scaled curve agree with it: nothing moves, the record keeps the latest
        assert V.note_verify_steps(m, [1.03] * LIVE_KEPT, 1.4) == pytest.approx(1.4)
        assert V.verify_costs(m, 9) == scaled
        # the machine got faster: relative to the scaled curve its steps cost 0.7 of it
        assert V.note_verify_steps(m, [0.7] * LIVE_KEPT, 1.4) == pytest.approx(0.98)
        mine = [c for c in V.cached_costs() if c["model"] == str(target_path.resolve())]
        assert mine[0]["measured"] == measured and mine[0]["scale"] == pytest.approx(0.98)
        assert mine[0]["live_steps"] == LIVE_KEPT and mine[0]["ratio"][2] == pytest.approx(1.49)
        db = read_json(M.CACHE_FILE)
        key = next(k for k in db if k.startswith(M.COST_KEY))
        db[key].update(scale="fast", live={"a": 1})
        write_json(M.CACHE_FILE, db)
        assert V.verify_costs(m, 9) == measured
        assert V.note_verify_steps(m, [1.0], 1.0) == 1.0


def test_the_stored_scale_does_not_stay_away_from_the_evidence(target_path, tmp_path, monkeypatch):
    """A stored scale set by a slow stretch must come back when the judgements kept since say otherwise: the median
    of the kept judgements decides, within a band narrow enough that the scale never sits far from them (a 20% band
    held a scale of 1.53 over judgements whose median was 1.30, and `auto` drafted less than the machine paid for)."""
    from localspec.core import verify_cost as V
    from localspec.core.verify_cost import LIVE_KEPT, LIVE_KEPT_BAND
    from localspec.llama.model import Model

    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(V, "_measure_costs", lambda m, upto: {b: 1.0 + 0.5 * (b - 1) for b in range(1, 10)})
    with Model(target_path, n_ctx=512) as m:
        V.verify_costs(m, 9)
        assert V.note_verify_steps(m, [1.53] * LIVE_KEPT, 1.0) == pytest.approx(1.53)  # a slow stretch
        # the answers after it: steps that cost 1.30 of the calibrated extra cost, judged against 1.53
        assert V.note_verify_steps(m, [1.30 / 1.53] * LIVE_KEPT, 1.53) == pytest.approx(1.30)
        # noise within the band moves nothing
        wobble = 1.0 + LIVE_KEPT_BAND / 2
        assert V.note_verify_steps(m, [wobble] * LIVE_KEPT, 1.30) == pytest.approx(1.30)


def test_a_generation_hands_its_verify_steps_to_the_calibration(target_path, tmp_path, monkeypatch):
    """The engine keeps each adaptive generation's judgements with the calibration and prices the next answer by
    the calibration as now scaled (a chat's controller keeps its curve across answers: it is reset to it)."""
    from types import SimpleNamespace

    from localspec.core import verify_cost as V
    from localspec.core.engine import Engine, GenConfig
    from localspec.core.pricing import LIVE_MIN, VerifyCurve

    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(V, "_measure_costs", lambda m, upto: {b: 1.0 + 0.5 * (b - 1) for b in range(1, upto + 1)})
    e = Engine.load(target_path, n_ctx=512)
    try:
        seen = []
        real = e.note_verify_steps
        monkeypatch.setattr(e, "note_verify_steps", lambda policy: seen.append(policy) or real(policy))
        e.complete(e.raw_prompt("the cat sat on the mat. the cat sat on the"),
                   GenConfig(method="lookup", k=3, max_tokens=8, adaptive=True))
        assert len(seen) == 1 and isinstance(seen[0].curve, VerifyCurve)
        curve = VerifyCurve(prior=dict(e.verify_costs(9)), scale=1.5, live=[1.5] * LIVE_MIN)
        e.note_verify_steps(SimpleNamespace(curve=curve))
        assert V.cost_scale(e.target) == pytest.approx(1.5)
        assert e.verify_costs(9)[3] == pytest.approx(2.5) and curve.prior == e.verify_costs(9)
        assert curve.scale == 1.0 and curve.live == []  # the scale now lives in the calibration it is priced by
    finally:
        e.close()


def test_doctor_shows_the_calibrations_that_apply_to_the_files_as_they_are(target_path, tmp_path, monkeypatch):
    """A probe and a verify-cost calibration belong to one version of a model file and one llama.cpp build. Once the
    file is replaced at the same path (another modification time), its old entries are never used again: doctor
    shows the entries the current file would be priced by, and counts the others, instead of listing an earlier
    version's curve and scale under the same file name."""
    import os
    import shutil

    from localspec.core import exactness as X
    from localspec.core import verify_cost as V
    from localspec.llama.model import Model
    from tests.helpers import cli

    cache = tmp_path / "cache"
    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(cache))
    f = tmp_path / "pair.gguf"
    shutil.copy(target_path, f)
    for slope in (0.5, 0.7):  # the first version, then the same path replaced by a file measured otherwise
        if slope == 0.7:
            st = f.stat()
            os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        monkeypatch.setattr(V, "_measure_costs", lambda m, upto, s=slope: {b: 1.0 + s * (b - 1) for b in range(1, 10)})
        with Model(f, n_ctx=512) as m:
            V.verify_costs(m, 9)
            X.max_exact_batch(m, 3)
    costs = [c for c in V.cached_costs() if c["model"] == str(f.resolve())]
    assert sorted((c["ratio"][2], c["current"]) for c in costs) == [(1.5, False), (1.7, True)]
    probes = [p for p in X.cached_probes() if p["model"] == str(f.resolve())]
    assert sorted(p["current"] for p in probes) == [False, True]
    r = cli(["doctor"], env={"LOCALSPEC_CACHE_DIR": str(cache)}, timeout=120)
    out = r.stdout.decode()
    assert r.returncode == 0, r.stderr
    assert "verify cost: pair.gguf" in out and "2:1.70" in out and "2:1.50" not in out, out
    assert out.count("exactness probe: pair.gguf") == 1, out
    assert "1 verify-cost calibration and 1 exactness probe for other llama.cpp builds or earlier versions" in out, out
