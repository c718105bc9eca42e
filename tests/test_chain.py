"""drafters/chain.py: a model drafter's proposal extended by the suffix drafter's continuation of it (llama.cpp's
chained drafting): what it proposes, what it reports back to the model, how a sampled proposal stays verifiable,
that `auto` offers it beside its parts, that decoding with it is plain decoding at temperature 0, and the replayed
gain where a verify of several rows costs about one."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from conftest import PROMPTS
from localspec.bench import replay as R
from localspec.drafters import ChainedDrafter, chained
from localspec.drafters.base import Drafter, Proposal
from localspec.drafters import suffix as S
from localspec.sample.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("fresh_suffix_cache")  # each test: its own cache, no corpus left over


class Scripted(Drafter):
    """A model drafter that proposes `tokens` (with one q row each when `n_vocab` is given) and records feedback."""

    name = "draft"

    def __init__(self, tokens, n_vocab=None):
        self.tokens, self.n_vocab, self.fed = list(tokens), n_vocab, []

    def propose(self, context, k, sp, rng):
        toks = self.tokens[:k]
        q = None
        if self.n_vocab:
            q = np.full((len(toks), self.n_vocab), 1.0 / self.n_vocab, dtype=np.float32)
        return Proposal(toks, q)

    def accept(self, n_drafted, n_accepted):
        self.fed.append((n_drafted, n_accepted))

    def cost(self):
        return 0.25


def suffix_over(text):
    d = S.SuffixDrafter(None)
    d.begin(list(text))
    return d


def test_a_replayed_chain_pays_for_its_models_tokens_only():
    """A recorded draft model's tokens cost its draft cost on the replay's clock; the suffix drafter's are free."""
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    clock = R.SimClock()
    model = R.RecordedDrafter("draft", len(ctx) - 1, [[4, 5]], 0.5, clock)
    chain = ChainedDrafter(model, suffix_over(ctx))
    assert len(chain.propose(ctx, 6, SamplingParams(), None).tokens) == 6
    assert clock() == pytest.approx(2 * 0.5 * R.T1)
    model.propose(ctx, 2, SamplingParams(), None)
    assert clock() == pytest.approx(2 * 2 * 0.5 * R.T1)


def test_the_chain_continues_the_models_drafts_from_the_suffix_index():
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]  # the request so far: 1 2 3 was followed by 4 5 6 7 ...
    tail = suffix_over(ctx)
    chain = ChainedDrafter(Scripted([4, 5]), tail)
    p = chain.propose(ctx, 6, SamplingParams(), np.random.default_rng(0))
    assert p.tokens == [4, 5, 6, 7, 8, 9] and p.q is None
    assert chain.name == "draft+suffix" and chain.cost() == 0.25
    chain.accept(6, 5)  # the model hears of its own two drafts only
    chain.accept(6, 1)
    assert chain.model.fed == [(2, 2), (2, 1)]
    # at k the model's proposal is whole: nothing is added; where the index has nothing, the model's stands
    assert chain.propose(ctx, 2, SamplingParams(), None).tokens == [4, 5]
    assert ChainedDrafter(Scripted([40, 41]), tail).propose(ctx, 6, SamplingParams(), None).tokens == [40, 41]
    # the proposed drafts were not indexed: the request's own match is unchanged
    assert tail.match(ctx, 4)[0] == [4, 5, 6, 7]


def test_a_sampled_proposal_gets_a_certain_row_for_each_added_token():
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    chain = ChainedDrafter(Scripted([4, 5], n_vocab=16), suffix_over(ctx))
    p = chain.propose(ctx, 5, SamplingParams(temperature=1.0), np.random.default_rng(0))
    assert p.tokens == [4, 5, 6, 7, 8]
    assert p.q.shape == (5, 16)
    assert np.allclose(p.q[:2], 1 / 16)  # the model's own rows
    assert [int(np.argmax(r)) for r in p.q[2:]] == [6, 7, 8] and np.allclose(p.q[2:].sum(axis=1), 1.0)
    assert np.count_nonzero(p.q[2:]) == 3


def test_auto_offers_each_model_drafter_chained_with_the_suffix_drafter_and_nothing_else():
    lookup, tail, draft = R.PromptLookupDrafter(), S.SuffixDrafter(None), Scripted([1])
    out = chained({"lookup": lookup, "suffix": tail, "draft": draft})
    assert set(out) == {"lookup", "suffix", "draft", "draft+suffix"}
    assert out["draft+suffix"].model is draft and out["draft+suffix"].tail is tail
    assert chained({"lookup": lookup, "draft": draft}) == {"lookup": lookup, "draft": draft}  # no cache: no chain


def test_decoding_through_the_chain_is_plain_decoding_at_temperature_0(engine, monkeypatch):
    """The tiny target with its (low-acceptance) draft model, the controller made to draft at k=6 on every step,
    once through the draft model alone and once through the chain: both answers are plain decoding's, and the
    chain's drafts were accepted far more often: the cache (the first answer to the same prompt) went on where
    the draft model was unsure."""
    from localspec.core import policy as P
    from localspec.core.engine import GenConfig

    prompt = engine.raw_prompt(PROMPTS[0])
    plain = engine.complete(prompt, GenConfig(method="none", max_tokens=60)).tokens
    engine.complete(prompt, GenConfig(method="suffix", max_tokens=60))  # the cache now holds this answer
    real_choose = P.AdaptivePolicy.choose
    runs = {}
    for name in ("draft", "draft+suffix"):
        seen = []

        def forced(self, context, name=name, seen=seen):
            real_choose(self, context)
            seen.append(sorted(self.drafters))
            return self.drafters[name], 6

        monkeypatch.setattr(P.AdaptivePolicy, "choose", forced)
        fin = engine.complete(prompt, GenConfig(method="auto", k=6, max_tokens=60, exactness="lossless", p_min=0.99))
        assert fin.tokens == plain, name
        assert seen and all("draft+suffix" in s for s in seen)  # auto offers the chain beside its parts
        runs[name] = fin.stats
    assert runs["draft+suffix"].drafted_by["draft+suffix"] > 0
    assert runs["draft+suffix"].accepted >= runs["draft"].accepted + 10, (runs["draft"].accepted,
                                                                           runs["draft+suffix"].accepted)


def test_replayed_the_chain_pays_where_a_wide_verify_costs_about_one_row():
    """SmolLM2-135M's recorded proposals (p_min 0.75) for Qwen2.5-Coder-1.5B's answers: with the chain beside its
    parts, `auto` is ahead over the twelve prompts where 9 rows cost about one (a GPU), with the chain's model tokens
    paid for and its cache tokens free, and no prompt loses more than the noise of probing it on the 2-core CPU
    curves."""
    traces = R.load(ROOT / "benchmarks" / "data" / "smollm2_for_qwen_coder_traces.json")

    def ratios(curve, chain):
        return [R.replay(t, R.auto_recorded("draft", curve, 8, None, None, chain=chain), curve, 128)["rate"]
                / R.replay(t, R.plain(), curve, 128)["rate"] for t in traces]

    def geomean(xs):
        return math.exp(sum(map(math.log, xs)) / len(xs))

    flat = R.CURVES["flat"]
    assert geomean(ratios(flat, True)) >= 1.02 * geomean(ratios(flat, False))
    for name in ("avx512", "epyc"):
        with_chain, without = ratios(R.CURVES[name], True), ratios(R.CURVES[name], False)
        assert geomean(with_chain) >= geomean(without), name
        assert min(a / b for a, b in zip(with_chain, without)) >= 0.98, name
