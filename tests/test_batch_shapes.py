"""Batched serving (core/batch.py) and the shapes of its forward passes: llama.cpp runs a batch over separate KV
streams as passes of consecutive sequences with equal rows each (multiseq.split_equal). The exactness probe
decodes those shapes; a step pads its slots to one pass where that keeps each request's exactness."""

import functools

import numpy as np
import pytest

from conftest import PROMPTS, require_exact_batching
from helpers import alone, gen_config
from localspec.core.batch import BatchEngine
from localspec.llama.multiseq import split_equal

N = 60
cfg_for = functools.partial(gen_config, max_tokens=N)


def perturb_passes(ms, hit, eps=1e-3):
    """A MultiSeq whose logits change by eps (far below the tiny models' margins) in the forward passes where
    hit(ubatch, rows per sequence) says so; llama.cpp's passes as multiseq.split_equal models them."""
    orig = ms.decode

    def decode(parts, copy=True):
        outs = orig(parts, copy=True)
        rows = {p[0]: len(p[1]) for p in parts}
        for ub in split_equal([(p[0], len(p[1])) for p in parts], ms.n_batch):
            if len(ub) < 2 or not hit(ub, rows):
                continue
            for seq, first, n in ub:
                j = next(j for j, p in enumerate(parts) if p[0] == seq)
                for i, row in enumerate(sorted(set(parts[j][2]))):
                    if first <= row < first + n:
                        outs[j][i] += eps
        return outs

    ms.decode = decode


def perturb_big_passes(ms, min_rows=4):
    """Logits change only in passes of min_rows rows or more from two requests or more: what ggml-cpu's repacked
    Q4_K GEMM (4-row groups) does beside its GEMV (alone, the engine's own k cap covers it)."""
    perturb_passes(ms, lambda ub, rows: sum(n for _, _, n in ub) >= min_rows)


def staggered(b, requests):
    """Run requests joining one a step (their prompts beside the others' 1-row steps, not beside other prompts)."""
    done = {}
    for i, (prompt, cfg) in enumerate(requests):
        b.add(prompt, cfg, sink=lambda ev, i=i: done.setdefault(i, ev) if hasattr(ev, "stats") else None)
        b.step()
    while b.active:
        b.step()
    return [done[i] for i in range(len(requests))]


def count_passes(b):
    """Record, per decode, the forward passes llama.cpp runs it as."""
    seen = []
    orig = b.ms.decode

    def decode(parts, copy=True):
        seen.append((b.ms.passes([(p[0], len(p[1])) for p in parts]), [len(p[1]) for p in parts]))
        return orig(parts, copy)

    b.ms.decode = decode
    return seen


# ------------------------------------------------------------------ llama.cpp's split, modelled
def test_split_equal_takes_consecutive_sequences_with_equal_rows():
    assert split_equal([(0, 1), (1, 3), (2, 1), (3, 2)], 512) == [
        [(0, 0, 1), (1, 0, 1), (2, 0, 1), (3, 0, 1)], [(1, 1, 2)], [(3, 1, 1)]]
    assert split_equal([(0, 2), (2, 2)], 512) == [[(0, 0, 2)], [(2, 0, 2)]]  # slots 0 and 2: two passes
    assert split_equal([(0, 3), (1, 3), (2, 3)], 512) == [[(0, 0, 3), (1, 0, 3), (2, 0, 3)]]
    assert split_equal([(0, 10), (1, 10)], 8) == [[(0, 0, 4), (1, 0, 4)], [(0, 4, 4), (1, 4, 4)],
                                                  [(0, 8, 2), (1, 8, 2)]]


def test_split_equal_matches_what_llama_cpp_computes(engine):
    """The model is right about the rows: a row's logits in a batch of uneven slots equal those of the same rows
    decoded as the passes split_equal names (no output of llama.cpp says how it split; logits do)."""
    b = BatchEngine(engine, 4)
    try:
        ms = b.ms
        toks = engine.raw_prompt(PROMPTS[0])[:4]
        ms.clear()
        for s in range(4):
            ms.decode([(s, toks, [])])
        got = ms.decode([(0, [5], [0]), (1, [6, 7, 8], range(3)), (2, [9], [0]), (3, [10, 11], range(2))])
        assert [len(g) for g in got] == [1, 3, 1, 2]
        assert all(np.isfinite(g).all() for g in got)
    finally:
        b.close()


# ------------------------------------------------------------------ the probe
def test_the_probe_sees_passes_of_four_rows_from_four_requests(engine, exact_batching):
    """A build whose logits change only in passes of >= 4 rows (4 requests x 1 row, 2 x 2, ...): the probe must
    not call batching bit-exact. (A probe of two sequences only misses it: llama.cpp splits a '3 rows of another
    request' case into 1 + 1 rows and then that request alone.)"""
    require_exact_batching(exact_batching)
    b = BatchEngine(engine, 4)
    try:
        perturb_big_passes(b.ms)
        exact, why = b.probe()
        assert not exact
        assert "4 x 1" in why and "not bit-identical" in why
        res = b.probe_result()
        assert res.shapes[(3, 1)] and not res.shapes[(4, 1)] and not res.shapes[(2, 2)] and res.shapes[(1, 4)]
    finally:
        b.close()


def test_the_probe_calls_exact_only_what_is(engine, exact_batching):
    require_exact_batching(exact_batching)
    b = BatchEngine(engine, 4)
    try:
        exact, why = b.probe()
        assert exact, why  # F16 weights: a row's sum does not depend on the rows beside it
        res = b.probe_result()
        assert all(res.shapes.values()) and (4, b.bit_rows()) in res.shapes
    finally:
        b.close()


def test_exactness_is_per_request_from_the_passes_it_shared(engine, exact_batching):
    """Where passes of 4+ rows are not bit-exact: a request that runs alone stays bit; requests that share such a
    pass report lossless, and why; the texts are still the sequential ones (margins far above the noise)."""
    require_exact_batching(exact_batching)
    b = BatchEngine(engine, 4)
    try:
        perturb_big_passes(b.ms)
        p = [engine.raw_prompt(x) for x in PROMPTS]
        cfg = lambda: cfg_for("none", exactness="bit")  # noqa: E731
        one = b.generate_all([(p[0], cfg())])[0]
        assert one.stats.exactness == "bit", one.stats.exactness_reason
        # one joining while another generates: its prompt beside 1 row (2 x 1 rows, then the prompt alone), then
        # 2 x 1 rows a step: below the 4 rows
        two = staggered(b, [(p[0], cfg()), (p[1], cfg())])
        assert [two[i].stats.exactness for i in (0, 1)] == ["bit", "bit"], two[1].stats.exactness_reason
        assert two[1].tokens == alone(engine, p[1], cfg()).tokens
        # both joining at once: their prompts would share a pass of 2 x 10 rows, so each decodes on its own, and
        # then 2 x 1 rows a step: bit, both
        both = b.generate_all([(p[2], cfg()), (p[3], cfg())])
        assert [x.stats.exactness for x in both] == ["bit", "bit"], both[0].stats.exactness_reason
        assert [x.tokens for x in both] == [alone(engine, x, cfg()).tokens for x in p[2:]]
        four = b.generate_all([(x, cfg()) for x in p])
        for x, prompt in zip(four, p):
            assert x.stats.exactness == "lossless"
            assert "shared a pass" in x.stats.exactness_reason and "4 x 1" in x.stats.exactness_reason
            assert x.tokens == alone(engine, prompt, cfg()).tokens
    finally:
        b.close()


# ------------------------------------------------------------------ one pass a step
def repeating_prompt(engine, i):
    """A prompt that repeats the model's own answer: prompt lookup drafts long runs on it."""
    p = engine.raw_prompt(PROMPTS[i])
    own = alone(engine, p, cfg_for("none", max_tokens=30)).tokens
    return p + own + p + own + p


def test_slots_with_different_draft_lengths_take_one_pass_and_give_the_same_texts(engine, exact_batching):
    require_exact_batching(exact_batching)
    b = BatchEngine(engine, 4, pad=True)
    try:
        prompts = [repeating_prompt(engine, 0), engine.raw_prompt(PROMPTS[1]), repeating_prompt(engine, 2),
                   engine.raw_prompt(PROMPTS[3])]
        cfgs = [cfg_for("lookup", k=4, exactness="bit"), cfg_for("none"), cfg_for("lookup", k=3, exactness="bit"),
                cfg_for("none", exactness="bit")]
        want = [alone(engine, p, c) for p, c in zip(prompts, cfgs)]
        seen = count_passes(b)
        b.probe()
        seen.clear()
        got = b.generate_all(list(zip(prompts, cfgs)))
        gen_steps = [(passes, rows) for passes, rows in seen if len(rows) == 4 and max(rows) <= 5]
        uneven = [rows for passes, rows in gen_steps if len(set(rows)) > 1]
        assert not uneven  # every 4-slot generating step was padded to equal rows ...
        assert any(max(rows) > 1 for _, rows in gen_steps)  # ... where some slots drafted
        assert all(len(passes) == 1 for passes, _ in gen_steps)  # ... so it ran as one pass
        for g, w in zip(got, want):
            assert g.tokens == w.tokens and g.text == w.text
            assert g.stats.exactness == "bit"
        assert got[0].stats.accepted > 0
        # unpadded (LOCALSPEC_BATCH_PAD=0): the same texts, in uneven passes
        b.pad = False
        seen.clear()
        again = b.generate_all(list(zip(prompts, cfgs)))
        assert [g.tokens for g in again] == [w.tokens for w in want]
        assert any(len(set(rows)) > 1 for _, rows in seen)
    finally:
        b.close()


def test_no_padding_past_what_a_bit_request_may_share(engine, exact_batching):
    """Where passes of 4+ rows are not bit-exact, a bit request's 1-row step is not padded up to its neighbour's
    drafts (that would make the pass inexact): uneven rows stay uneven there."""
    require_exact_batching(exact_batching)
    b = BatchEngine(engine, 2)
    try:
        perturb_big_passes(b.ms, min_rows=4)
        seen = count_passes(b)
        b.probe()
        seen.clear()
        prompts = [engine.raw_prompt(PROMPTS[1]), repeating_prompt(engine, 0)]
        cfgs = [cfg_for("none", exactness="bit"), cfg_for("lookup", k=4, exactness="lossless")]
        got = staggered(b, list(zip(prompts, cfgs)))
        assert got[0].stats.exactness == "bit", got[0].stats.exactness_reason
        assert got[0].tokens == alone(engine, prompts[0], cfgs[0]).tokens
        assert got[1].stats.drafted > 0
        assert any(len(set(rows)) > 1 for _, rows in seen)
    finally:
        b.close()


def test_a_new_request_keeps_the_active_slots_consecutive(engine):
    b = BatchEngine(engine, 4)
    try:
        b.runs = [None, object(), None, None]
        assert b._choose_slot([5, 6, 7], [0, 2, 3]) == 0
        b.runs = [object(), None, object(), None]
        assert b._choose_slot([5, 6, 7], [1, 3]) == 1
        # a long cached prefix wins over consecutiveness (a continued chat)
        b.runs = [object(), None, None, None]
        b.ms.tokens[3] = list(range(40))
        assert b._choose_slot(list(range(40)) + [1], [1, 2, 3]) == 3
        assert b._choose_slot([7] * 30, [1, 2, 3]) == 1
    finally:
        b.runs = [None] * 4
        b.ms.tokens[3] = []
        b.close()


def test_padding_only_where_the_verify_curve_says_one_padded_pass_is_cheaper(engine, monkeypatch):
    """On a compute-bound CPU every row costs about half a step, and padding rows [1,3,1,2] to [3,3,3,3] costs more
    than the three passes it replaces (Qwen2.5-Coder-1.5B, 2 cores: 657 vs 451 ms); on a GPU rows are nearly free and
    each pass is what costs. By default the step pads only where the target's calibrated curve says it pays."""
    b = BatchEngine(engine, 4)
    try:
        assert b.pad is None  # by cost
        cpu = {1: 1.0, 2: 1.60, 3: 2.19, 4: 2.67, 5: 3.27, 6: 3.81, 7: 4.46, 8: 6.64, 9: 7.07}
        gpu = {n: 1.0 + 0.02 * (n - 1) for n in range(1, 10)}
        rows = [(0, 1), (1, 3), (2, 1), (3, 2)]
        b._curve = cpu
        assert not b._padding_pays(rows, 3)
        b._curve = gpu
        assert b._padding_pays(rows, 3)
        # the steps themselves: with the CPU curve, uneven slots stay uneven
        b._curve = cpu
        seen = count_passes(b)
        b.probe()
        seen.clear()
        prompts = [repeating_prompt(engine, 0), engine.raw_prompt(PROMPTS[1]), repeating_prompt(engine, 2),
                   engine.raw_prompt(PROMPTS[3])]
        # lossless: a `bit` request is padded only where the probe found the padded shape bit-identical, which
        # depends on this CPU's kernels; the cost rule is what is under test here
        cfgs = [cfg_for("lookup", k=4, exactness="lossless"), cfg_for("none", exactness="lossless"),
                cfg_for("lookup", k=3, exactness="lossless"), cfg_for("none", exactness="lossless")]
        b.generate_all(list(zip(prompts, cfgs)))
        assert any(len(set(r)) > 1 for _, r in seen if len(r) == 4)
        b._curve = gpu
        seen.clear()
        b.generate_all(list(zip(prompts, cfgs)))
        assert not [r for _, r in seen if len(r) == 4 and max(r) <= 5 and len(set(r)) > 1]
    finally:
        b.close()


def test_a_request_that_leaves_bit_in_a_batch_drops_the_bit_k_cap(engine, monkeypatch):
    """A bit request's k is capped where bigger verify batches are not bit-exact; once a shared pass has made it
    lossless the cap only costs speed, so it drafts up to the k it asked for."""
    monkeypatch.setattr(engine, "exact_k", lambda k, cancel=None: min(k, 2))  # a CPU build's cap: k <= 2
    b = BatchEngine(engine, 4)
    try:
        perturb_big_passes(b.ms, min_rows=4)
        engine_cap = b.bit_rows() - 1
        assert engine_cap == 2
        b.probe()
        prompts = [repeating_prompt(engine, i) for i in range(4)]
        cfgs = [cfg_for("lookup", k=6, exactness="bit") for _ in range(4)]
        got = b.generate_all(list(zip(prompts, cfgs)))
        lossless = [g for g in got if g.stats.exactness == "lossless"]
        assert lossless, [g.stats.exactness_reason for g in got]
        for g in lossless:
            assert g.stats.k_cap == 6
        assert any(max(int(k) for k in g.stats.k_used) > engine_cap for g in lossless)
    finally:
        b.close()


def test_a_slots_drafted_rows_are_priced_by_what_they_cost_the_whole_batch(engine):
    """Over separate KV streams a slot's drafted rows run as a pass of their own beside the others' one-row steps, so
    on a compute-bound CPU a 2-row verify in a 4-slot step costs 2.5 plain-step shares, not the 1.6 of the target
    alone; in one unified cache they join the pass; on a GPU they cost next to nothing. The slots' controllers get
    those prices each step (alone: the calibrated curve itself)."""
    from localspec.core.batch_cost import batch_ratios

    cpu = {1: 1.0, 2: 1.60, 3: 2.19, 4: 2.67, 5: 3.27, 6: 3.81, 7: 4.46, 8: 6.64, 9: 7.07}
    gpu = {n: 1.0 + 0.02 * (n - 1) for n in range(1, 10)}
    assert batch_ratios(cpu, 1, False, True, 9) == cpu
    streams, unified = batch_ratios(cpu, 4, False, True, 9), batch_ratios(cpu, 4, True, True, 9)
    assert streams[2] == pytest.approx(1 + 1.0 / (2.67 / 4))  # T(4) + T(1), over T(4)/4 a share
    assert cpu[2] < unified[2] < streams[2]
    assert max(batch_ratios(gpu, 4, True, True, 9)[b] for b in range(1, 6)) < 1.35
    b = BatchEngine(engine, 4)
    try:
        b._curve = cpu
        b.probe()
        prompts = [repeating_prompt(engine, i) for i in range(4)]
        for p in prompts:
            b.add(p, cfg_for("auto", k=4))
        while any(r is not None and r.prefill for r in b.runs):
            b.step()
        b.step()
        pol = next(r.policy for r in b.runs if r is not None)
        assert pol.curve.prior[2] == pytest.approx(batch_ratios(cpu, 4, False, b.pad is not False, 9)[2])
        while b.active:
            b.step()
        b.add(prompts[0], cfg_for("auto", k=4))
        while b.active:
            b.step()
            run = next((r for r in b.runs if r is not None), None)
            if run is not None and not run.prefill:
                assert run.policy.curve.prior[2] == pytest.approx(cpu[2])  # alone: the target's own curve
    finally:
        b.close()


def perturb_prompt_beside_others(ms, prompt_rows=5):
    """Logits change only in passes where a prompt chunk (a part of prompt_rows rows or more) shares the pass with
    other requests' rows: what the probe found on a 2-core CPU with Qwen Q4_K_M, where 1-row steps side by side
    stay bit-identical."""
    perturb_passes(ms, lambda ub, rows: any(rows[seq] >= prompt_rows for seq, _, _ in ub))


@pytest.mark.parametrize("arrival", ["one a step", "together"])
def test_a_joining_prompt_decodes_apart_where_beside_others_it_would_cost_them_bit(engine, arrival, exact_batching):
    """Where a prompt chunk beside other requests' rows is not bit-identical, a step with a joining prompt decodes
    the generating rows first and the prompt on its own, and two prompts joining in the same step one after the
    other: the requests all stay bit, the running one and two arriving together alike. Over separate KV streams
    that costs no extra pass: a prompt's rows past the shared pass run alone anyway."""
    require_exact_batching(exact_batching)
    b = BatchEngine(engine, 4)
    try:
        perturb_prompt_beside_others(b.ms)
        res = b.probe_result()
        assert res.shapes[(2, 1)] and not res.beside_prompt[2], res.why
        seen = count_passes(b)
        p = [engine.raw_prompt(x) for x in PROMPTS[:2]]
        cfg = lambda: cfg_for("none", exactness="bit")  # noqa: E731
        requests = [(p[0], cfg()), (p[1], cfg())]
        two = staggered(b, requests) if arrival == "one a step" else b.generate_all(requests)
        for x, prompt in zip(two, p):
            assert x.stats.exactness == "bit", x.stats.exactness_reason
            assert x.tokens == alone(engine, prompt, cfg()).tokens
        # each prompt decoded alone (no pass holds a prompt beside other rows)
        assert any(rows == [len(p[1])] for _, rows in seen)
        assert any(rows == ([1] if arrival == "one a step" else [len(p[0])]) for _, rows in seen)
        assert all(max(rows) < 5 for _, rows in seen if len(rows) > 1)
    finally:
        b.close()
