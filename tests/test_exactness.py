"""The verify-cost calibration that the adaptive controller starts from."""

import pytest


def test_verify_costs_are_measured_once_and_cached(target_path, tmp_path, monkeypatch):
    from localspec.core import exactness as X
    from localspec.llama.model import Model
    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "cache"))
    with Model(target_path, n_ctx=512) as m:
        r = X.verify_costs(m, 5)
        assert sorted(r) == list(range(1, X.COST_MIN_UPTO + 1)) and r[1] == 1.0
        assert all(v > 0 for v in r.values())
        monkeypatch.setattr(X, "_measure_costs", lambda *a: pytest.fail("measured again"))
        assert X.verify_costs(m, 9) == r  # cached
        assert not [p for p in X.cached_probes() if "ratio" in p]  # doctor's probe list is not confused by it


def test_the_engine_reads_the_calibration_once(target_path, tmp_path, monkeypatch):
    """make_policy runs for every answer: the calibration is read from the cache file once per engine, not each time."""
    from localspec.core import exactness as X
    from localspec.core.engine import Engine, GenConfig

    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real = X.verify_costs
    monkeypatch.setattr(X, "verify_costs", lambda m, upto: calls.append(upto) or real(m, upto))
    e = Engine.load(target_path, n_ctx=512)
    try:
        for _ in range(3):
            e.complete(e.raw_prompt("the cat"), GenConfig(method="lookup", k=3, max_tokens=4, adaptive=True))
    finally:
        e.close()
    assert calls == [4]
