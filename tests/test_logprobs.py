"""Logprobs and logit_bias in the engine and the batch (core/engine.py, core/batch.py, sample/sampling.py): each
emitted token's logprob comes from the target row that emitted it (after bias and grammar), so at temperature 0 they
are the same with every method as with plain decoding; a banned token never appears, and speculation under a bias
gives plain decoding's output. A bias that leaves no token to emit is the request's error (a SettingError naming
logit_bias), never a banned token or a NaN logprob. (Through the server: test_server_logprobs.py.)"""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import PROMPTS
from helpers import LOGPROB_TOL as TOL
from localspec.core.engine import Engine, GenConfig, Piece
from localspec.errors import SettingError
from localspec.sample.sampling import SamplingParams

N = 24


@pytest.fixture(scope="module")
def engine(target_path):
    e = Engine.load(target_path, target_path, n_ctx=1024)  # the target as its own draft: drafts get accepted
    yield e
    e.close()


def pieces(engine, prompt, **kw):
    cfg = GenConfig(max_tokens=N, **kw)
    engine.target.clear()  # each run decodes the prompt the same way (a reused cache re-decodes its last token)
    return [ev for ev in engine.generate(engine.raw_prompt(prompt), cfg) if isinstance(ev, Piece) and ev.token >= 0]


@pytest.mark.parametrize("exactness", ["bit", "lossless"])
def test_logprobs_equal_plain_decodings_at_temperature_0_with_every_method(engine, exactness):
    for prompt in PROMPTS[:2]:
        plain = pieces(engine, prompt, method="none", logprobs=5)
        assert len(plain) == N
        for method in ("lookup", "draft"):
            got = pieces(engine, prompt, method=method, k=4, logprobs=5, exactness=exactness)
            assert [p.token for p in got] == [p.token for p in plain]
            if method == "draft":
                assert any(p.drafted for p in got)  # accepted drafts carry their own verify row's logprob
            for a, b in zip(got, plain):
                assert a.logprob == pytest.approx(b.logprob, abs=TOL)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
                assert [x for _, x in a.top] == pytest.approx([x for _, x in b.top], abs=TOL)
    # the logprobs are really the rows': the same run twice gives the same numbers exactly
    assert pieces(engine, PROMPTS[0], method="draft", k=4, logprobs=5, exactness=exactness) == \
        pieces(engine, PROMPTS[0], method="draft", k=4, logprobs=5, exactness=exactness)


def test_logprobs_sum_sensibly(engine):
    got = pieces(engine, PROMPTS[0], method="draft", k=4, logprobs=20)
    for p in got:
        assert p.logprob <= 0 and len(p.top) == 20
        assert p.top[0] == (p.token, p.logprob)  # greedy: the emitted token is the likeliest one
        lps = [x for _, x in p.top]
        assert lps == sorted(lps, reverse=True)
        assert 0 < sum(math.exp(x) for x in lps) <= 1 + 1e-9
    # the whole distribution of a row sums to 1
    from localspec.sample.sampling import token_logprobs

    row = np.random.default_rng(0).normal(size=50).astype(np.float32)
    _, top = token_logprobs(row, 3, 50)
    assert sum(math.exp(x) for _, x in top) == pytest.approx(1.0)


def test_no_logprobs_unless_asked(engine):
    assert all(p.logprob is None and p.top is None for p in pieces(engine, PROMPTS[0], method="draft", k=4))


def test_a_banned_token_never_appears_and_speculation_keeps_plain_output(engine):
    prompt = PROMPTS[0]
    plain = [p.token for p in pieces(engine, prompt, method="none")]
    ban = plain[len(plain) // 2]  # a token plain decoding emits
    bias = {ban: -100, plain[1]: 5.0}
    biased = {m: [p.token for p in pieces(engine, prompt, method=m, k=4, logit_bias=bias, logprobs=2)]
              for m in ("none", "lookup", "draft")}
    assert ban not in biased["none"] and biased["none"] != plain
    assert biased["lookup"] == biased["none"] == biased["draft"]
    # the logprobs are those of the biased row: the banned token is never among the alternatives
    got = pieces(engine, prompt, method="lookup", k=4, logit_bias=bias, logprobs=20)
    assert all(ban not in [t for t, _ in p.top] for p in got)


def test_logit_bias_reaches_the_draft_models_rows_too(engine):
    """logit_bias applies to the target's logits in every verify row and to the drafter's. With the target as its
    own draft, an unbiased draft would disagree with the biased target wherever the bias changes the choice; with the
    bias on the draft's rows too, the draft is the biased target and every draft is accepted (and the output stays
    that of plain decoding under the bias)."""
    prompt = PROMPTS[0]
    plain = [p.token for p in pieces(engine, prompt, method="none")]
    bias = {plain[3]: 25.0}
    cfg = GenConfig(max_tokens=N, method="draft", k=4, logit_bias=bias, p_min=0.0)
    engine.target.clear()
    events = list(engine.generate(engine.raw_prompt(prompt), cfg))
    fin = events[-1]
    assert fin.tokens == [p.token for p in pieces(engine, prompt, method="none", logit_bias=bias)]
    assert fin.tokens != plain  # the bias changes the answer
    assert fin.stats.drafted > 0 and fin.stats.accepted == fin.stats.drafted


class Narrowing:
    """A grammar that allows any token for its first `free` tokens, then only the tokens in `then`."""

    def __init__(self, n_vocab: int, free: int, then) -> None:
        self.n_vocab, self.free, self.n = n_vocab, free, 0
        self.then = np.zeros(n_vocab, dtype=bool)
        self.then[list(then)] = True

    def allowed(self):
        return np.ones(self.n_vocab, dtype=bool) if self.n < self.free else self.then.copy()

    def consume(self, tokens) -> bool:
        self.n += len(tokens)
        return True

    def rollback(self, n: int) -> bool:
        self.n -= n
        return True


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", ["none", "draft"])
def test_a_bias_that_bans_every_token_is_an_error_naming_logit_bias(engine, temperature, method):
    ban = {t: -100.0 for t in range(engine.target.n_vocab)}
    cfg = GenConfig(max_tokens=N, method=method, k=4, logit_bias=ban, logprobs=2,
                    sampling=SamplingParams(temperature=temperature, seed=1))
    with pytest.raises(SettingError) as err:
        list(engine.generate(engine.raw_prompt(PROMPTS[0]), cfg))
    assert err.value.settings == ("logit_bias",) and "every token" in str(err.value)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("method", ["none", "draft"])
def test_bias_and_grammar_leaving_no_token_end_in_an_error_not_a_banned_token(engine, temperature, method):
    """The grammar allows anything for 3 tokens, then only tokens the bias bans: the 3 tokens come out (none of
    them banned, every logprob finite), then the generation fails naming logit_bias."""
    target = engine.target
    then = [t for t in range(5, target.n_vocab, 7)]
    ban = {t: -100.0 for t in then + [2]}  # (the end-of-text token too: the answer cannot end early)
    cfg = GenConfig(max_tokens=N, method=method, k=4, logit_bias=ban, logprobs=3,
                    constraint=Narrowing(target.n_vocab, 3, then), p_min=0.0,
                    sampling=SamplingParams(temperature=temperature, seed=5))
    target.clear()
    got = []
    with pytest.raises(SettingError) as err:
        for ev in engine.generate(engine.raw_prompt(PROMPTS[0]), cfg):
            got.append(ev)
    assert err.value.settings == ("logit_bias",)
    toks = [p for p in got if isinstance(p, Piece) and p.token >= 0]
    assert len(toks) == 3 and not any(p.token in ban for p in toks)
    for p in toks:
        assert math.isfinite(p.logprob) and all(math.isfinite(x) for _, x in p.top)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_in_a_batch_a_bias_leaving_no_token_fails_that_request_only(engine, batch, temperature):
    """serve --parallel: the request whose bias and grammar leave no token fails naming logit_bias, with no banned
    token emitted; the request beside it answers as it does alone. A bias that bans every token is refused at once."""
    target = engine.target
    then = [t for t in range(5, target.n_vocab, 7)]
    ban = {t: -100.0 for t in then + [2]}
    sp = SamplingParams(temperature=temperature, seed=5)
    other = GenConfig(max_tokens=N, method="lookup", k=4, sampling=sp)
    alone = engine.complete(engine.raw_prompt(PROMPTS[1]), other)
    bad = GenConfig(max_tokens=N, method="lookup", k=4, logit_bias=ban, logprobs=3, sampling=sp,
                    constraint=Narrowing(target.n_vocab, 3, then))
    events: list = []
    batch.add(engine.raw_prompt(PROMPTS[0]), bad, sink=events.append)
    ends: list = []
    batch.add(engine.raw_prompt(PROMPTS[1]), other, sink=lambda ev: None if isinstance(ev, Piece) else ends.append(ev))
    while batch.active:
        batch.step()
    assert isinstance(events[-1], SettingError) and events[-1].settings == ("logit_bias",)
    toks = [p for p in events if isinstance(p, Piece) and p.token >= 0]
    assert len(toks) == 3 and not any(p.token in ban for p in toks)
    assert all(math.isfinite(p.logprob) for p in toks)
    assert ends[-1].tokens == alone.tokens
    with pytest.raises(SettingError) as err:
        batch.add(engine.raw_prompt(PROMPTS[0]), GenConfig(logit_bias={t: -100.0 for t in range(target.n_vocab)}))
    assert err.value.settings == ("logit_bias",)
