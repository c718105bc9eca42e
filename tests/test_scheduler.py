"""One scheduler, two backends (core/batch.py, core/backend.py): the same step tests pass with one slot on the
target's own context (what `run`, `chat`, `bench` and `serve --parallel 1` decode in) and with four slots of a
MultiSeq (`serve --parallel 4`)."""

import functools

import numpy as np
import pytest

from conftest import PROMPTS
from helpers import alone, gen_config
from localspec.core.backend import OwnContext
from localspec.core.batch import BatchEngine
from localspec.sample.sampling import SamplingParams
from localspec.errors import ContextOverflowError, SettingError, UsageError

N = 80
cfg_for = functools.partial(gen_config, max_tokens=N)


@pytest.fixture(scope="module", params=["own context, N=1", "MultiSeq, N=4"])
def sched(request, engine):
    b = (BatchEngine(engine, 1, own_context=True) if request.param.startswith("own")
         else BatchEngine(engine, 4, prefill_chunk=16))
    yield b
    b.close()


def test_the_backend_is_the_one_asked_for(sched, engine):
    if sched.n_slots == 1:
        assert isinstance(sched.ms, OwnContext) and sched.ms.tokens[0] is engine.target.tokens
        assert sched.layout == "single" and sched.drafts is None
    else:
        assert not isinstance(sched.ms, OwnContext) and sched.layout in ("split", "unified")
    assert sched.probe()[1] and sched.single_reason(cfg_for("draft")) == ""
    sched.calibrate()
    assert sched.fail_all() == [] and sched.active == 0


@pytest.mark.parametrize("method", ["none", "lookup", "auto", "draft"])
def test_requests_answer_what_they_answer_alone(sched, engine, method):
    want = [alone(engine, p, cfg_for(method)) for p in PROMPTS]
    got = sched.generate_all([(engine.raw_prompt(p), cfg_for(method)) for p in PROMPTS])
    for a, b in zip(want, got):
        assert (b.tokens, b.text, b.finish_reason) == (a.tokens, a.text, a.finish_reason)
        assert b.stats.completion_tokens == len(b.tokens) and b.stats.method == a.stats.method
        assert b.stats.exactness in ("bit", "lossless") and b.stats.exactness_reason
    assert sched.active == 0


def test_sampled_requests_keep_their_own_rng(sched, engine):
    cfgs = lambda: [cfg_for("none", sampling=SamplingParams(temperature=0.9, seed=s)) for s in (1, 2, 3, 4)]  # noqa: E731
    want = [alone(engine, PROMPTS[0], c) for c in cfgs()]
    got = sched.generate_all([(engine.raw_prompt(PROMPTS[0]), c) for c in cfgs()])
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert len({tuple(r.tokens) for r in got}) > 1  # the seeds do differ


def test_speculation_happens_inside_the_step(sched, engine):
    p = engine.raw_prompt(PROMPTS[0])
    own = alone(engine, PROMPTS[0], cfg_for("none", max_tokens=40)).tokens
    prompt = p + own + p + own + p
    cfg = lambda: cfg_for("lookup", k=4, max_tokens=60, exactness="lossless")  # noqa: E731
    want = engine.complete(list(prompt), cfg())
    got = sched.generate_all([(list(prompt), cfg()), (engine.raw_prompt(PROMPTS[1]), cfg())])
    st = got[0].stats
    assert got[0].tokens == want.tokens
    assert st.drafted > 0 and st.accepted > 0 and st.method_used["lookup"] > 0
    assert st.target_passes < st.completion_tokens  # some passes emitted more than one token


def test_per_request_max_tokens_and_stop(sched, engine):
    base = alone(engine, PROMPTS[0], cfg_for("none", max_tokens=40))
    stop = base.text[10:14]
    cfgs = [cfg_for("none", max_tokens=7), cfg_for("lookup", max_tokens=40, stop=[stop]),
            cfg_for("none", max_tokens=40)]
    got = sched.generate_all([(engine.raw_prompt(PROMPTS[0]), c) for c in cfgs])
    assert got[0].tokens == base.tokens[:7] and got[0].finish_reason == "length"
    assert got[1].finish_reason == "stop" and stop not in got[1].text and base.text.startswith(got[1].text)
    assert got[2].tokens == base.tokens


def test_a_request_cancelled_mid_way_ends_cancelled_and_the_next_answers_as_alone(sched, engine):
    import threading

    cancel = threading.Event()
    pieces: list = []
    resp = sched.submit(engine.raw_prompt(PROMPTS[1]), cfg_for("lookup"), cancel=cancel)
    resp.listen(pieces.append)
    for _ in range(4):
        sched.step()
    cancel.set()
    while sched.active:
        sched.step()
    fin = resp.result()
    assert fin.finish_reason == "cancelled" and 0 < len(fin.tokens) < N
    assert fin.tokens == alone(engine, PROMPTS[1], cfg_for("lookup")).tokens[:len(fin.tokens)]
    got = sched.generate_all([(engine.raw_prompt(PROMPTS[2]), cfg_for("lookup"))])[0]
    assert got.tokens == alone(engine, PROMPTS[2], cfg_for("lookup")).tokens


def test_a_requests_own_error_ends_it_and_the_scheduler_goes_on(sched, engine):
    from localspec.server.grammar import constraint_for

    con = constraint_for({"type": "json_object"}, engine.target)
    allowed = np.flatnonzero(con.allowed()[:engine.target.n_vocab])
    bad = cfg_for("none", max_tokens=20, constraint=con, logit_bias={int(t): -100.0 for t in allowed})
    resp = sched.submit(engine.raw_prompt(PROMPTS[0]), bad)
    while sched.active:
        sched.step()
    with pytest.raises(SettingError, match="logit_bias"):
        resp.result()
    got = sched.generate_all([(engine.raw_prompt(PROMPTS[1]), cfg_for("none", max_tokens=20))])[0]
    assert got.tokens == alone(engine, PROMPTS[1], cfg_for("none", max_tokens=20)).tokens


def test_bad_prompts_are_errors_not_crashes(sched):
    with pytest.raises(UsageError):
        sched.add([], cfg_for("none"))
    with pytest.raises(ContextOverflowError):
        sched.add([5] * 2000, cfg_for("none"))
    assert sched.active == 0
