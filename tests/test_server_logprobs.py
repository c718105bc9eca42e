"""logprobs / top_logprobs and logit_bias (issue #23 item 5): each emitted token's logprob comes from the target
row that emitted it (after bias and grammar), so at temperature 0 they are the same with every method as with
plain decoding; a banned token never appears, and speculation under a bias gives plain decoding's output."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import PROMPTS
from localspec.core.engine import Engine, GenConfig, Piece

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


# A verify row equals the one-token decode of its position only up to llama.cpp's float order: on CPU the KV view
# a decode attends over is padded differently when rows arrive in batches, which moves logits by up to ~5e-3 on the
# tiny F16 model (also at exactness bit, whose probe compares batch shapes on one cache layout). Log-softmax moves
# by at most twice that, so the logprobs are compared within 1e-2 and the tokens exactly.
TOL = 1e-2


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
    from localspec.core.sampling import token_logprobs

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
