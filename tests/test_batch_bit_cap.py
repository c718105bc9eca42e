"""The k a `bit` request may verify with is what a probe found bit-identical in the context it decodes in: alone,
the target's own probe (it covers k + 1 rows); in a batch, the pass shapes the batch's probe decoded (up to
bit_rows() rows a request), whatever the method, and `k_in_use` reports that cap."""

import pytest

from conftest import PROMPTS
from helpers import alone, gen_config
from localspec.core import batch_probe as BP
from localspec.core import exactness as X
from localspec.core.batch import BatchEngine

N = 40


@pytest.fixture
def every_batch_exact(engine, monkeypatch):
    """A machine where every verify batch and every probed pass shape is bit-identical (an F16 model on a CPU)."""
    monkeypatch.setattr(X, "max_exact_batch", lambda model, upto, cancel=None: upto)
    monkeypatch.setattr(BP, "probe_batch", lambda ms, target, n, most: BP.ProbeResult(
        True, f"a row's logits are bit-identical with up to {n} requests x {most} rows in its forward pass"))
    monkeypatch.setattr(engine, "_probe", None)
    monkeypatch.setenv("LOCALSPEC_NO_COST_CALIBRATION", "1")


def repeating(engine):
    """A prompt that repeats the model's own answer: lookup and the n-gram cache draft long runs on it."""
    p = engine.raw_prompt(PROMPTS[0])
    own = alone(engine, p, gen_config("none", max_tokens=30)).tokens
    return p + own + p + own + p


@pytest.mark.parametrize("method", ["ngram", "lookup", "auto"])
def test_a_bit_request_in_a_batch_verifies_no_more_rows_than_the_batch_probe_decoded(engine, every_batch_exact,
                                                                                       method):
    prompt = repeating(engine)
    cfg = gen_config(method, max_tokens=N, k=64, exactness="bit")
    solo = alone(engine, prompt, cfg)
    assert solo.stats.exactness == "bit" and solo.stats.k_cap == 64  # alone, the probe covered 65 rows
    b = BatchEngine(engine, 2)
    try:
        b.probe()
        cap = b.bit_rows() - 1
        assert cap == 8
        (got,) = b.generate_all([(prompt, cfg)])
    finally:
        b.close()
    st = got.stats
    assert st.exactness == "bit" and st.k_cap == cap, (st.k_cap, st.exactness_reason)
    assert f"k capped at {cap}" in st.exactness_reason and "batch" in st.exactness_reason, st.exactness_reason
    assert st.drafted > 0 and max(int(k) for k in st.k_used) <= cap, st.k_used
    assert got.tokens == solo.tokens


def test_exactness_auto_in_a_batch_keeps_a_fixed_drafter_within_the_batch_cap(engine, every_batch_exact):
    """Under exactness auto the batch cap is a bit cap as the engine's own is: a fixed drafter keeps to it, at
    level bit."""
    prompt = repeating(engine)
    b = BatchEngine(engine, 2)
    try:
        b.probe()
        cap = b.bit_rows() - 1
        (fixed,) = b.generate_all([(prompt, gen_config("lookup", max_tokens=N, k=64, exactness="auto"))])
    finally:
        b.close()
    assert fixed.stats.exactness == "bit" and fixed.stats.k_cap == cap
    assert max(int(k) for k in fixed.stats.k_used) <= cap
