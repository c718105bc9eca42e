"""Exactness of speculative decoding on tiny fabricated models, KV rollback, stops, multi-turn reuse."""

import numpy as np
import pytest

from conftest import N_EXACT, PROMPTS
from helpers import assert_same_distribution, second_tokens
from localspec.llama.model import Model
from localspec.core.engine import Engine, Finished, GenConfig, Piece, TextAssembler
from localspec.errors import ContextOverflowError, IncompatibleDraftError, UsageError


@pytest.fixture(scope="module")
def self_engine(target_path):
    e = Engine.load(target_path, target_path, n_ctx=1024)
    yield e
    e.close()


@pytest.fixture(scope="module")
def plain(engine):
    return {p: engine.complete(engine.raw_prompt(p), GenConfig(method="none", max_tokens=N_EXACT)).tokens for p in PROMPTS}


def test_plain_is_long_enough(plain):
    for toks in plain.values():
        assert len(toks) == N_EXACT


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("which", ["low", "self"])
def test_draft_equals_plain(engine, self_engine, plain, k, which):
    e = engine if which == "low" else self_engine
    for p in PROMPTS:
        r = e.complete(e.raw_prompt(p), GenConfig(method="draft", k=k, max_tokens=N_EXACT, p_min=0.0, exactness="bit"))
        assert r.tokens == plain[p], (p, k, which)
        assert r.stats.exactness == "bit"
        assert r.stats.drafted > 0
        if which == "self":
            assert r.stats.accepted == r.stats.drafted  # the target drafting for itself: 100%
            assert r.stats.mean_accepted_length > r.stats.k_cap  # k accepted + 1 bonus per pass (less at the end)
        assert r.stats.k_cap == e.exact_k(k) and 1 <= r.stats.k_cap <= k


@pytest.mark.parametrize("k", [1, 3, 8])
def test_lookup_equals_plain(engine, plain, k):
    for p in PROMPTS:
        r = engine.complete(engine.raw_prompt(p), GenConfig(method="lookup", k=k, max_tokens=N_EXACT, exactness="bit"))
        assert r.tokens == plain[p]
    assert r.stats.method == "lookup"


def test_auto_adaptive_equals_plain(engine, plain):
    for p in PROMPTS:
        r = engine.complete(engine.raw_prompt(p), GenConfig(method="auto", k=8, max_tokens=N_EXACT, exactness="bit"))
        assert r.tokens == plain[p]
        assert sum(r.stats.k_used.values()) == r.stats.target_passes


def test_low_acceptance_draft_is_low(engine, plain):
    r = engine.complete(engine.raw_prompt(PROMPTS[0]), GenConfig(method="draft", k=4, max_tokens=N_EXACT, p_min=0))
    assert r.stats.acceptance_rate < 0.5


def test_stats_are_consistent(self_engine):
    r = self_engine.complete(self_engine.raw_prompt(PROMPTS[1]), GenConfig(method="draft", k=4, max_tokens=50, p_min=0))
    s = r.stats
    assert s.completion_tokens == 50 == len(r.tokens)
    assert s.completion_tokens == 1 + s.accepted + s.target_passes  # first token comes from the prompt pass
    assert s.drafted_at[0] == s.target_passes - s.k_used.get(0, 0) or s.drafted_at[0] <= s.target_passes
    assert sum(s.accepted_at) == s.accepted
    assert 0 < s.ttft_s <= s.elapsed_s and s.draft_s > 0 and s.verify_s > 0
    from localspec.core.report import figures

    d = figures(s)
    for key in ("acceptance_rate", "mean_accepted_length", "tokens_per_second", "acceptance_by_position"):
        assert key in d


def test_kv_rollback_matches_fresh_context(target_path):
    """After speculative steps with rejections, the next logits equal a fresh context fed the same tokens."""

    with Model(target_path, n_ctx=512) as m, Model(target_path, n_ctx=512) as fresh:
        ids = m.tokenize(PROMPTS[2])
        m.decode(ids)
        # decode 6 junk "draft" tokens with all rows, then reject 4 of them
        base = len(m.tokens)
        m.decode([10, 20, 30, 40, 50, 60], "all")
        m.truncate(base + 2)
        got = m.decode([77], "last")[0]
        want = fresh.decode(ids + [10, 20, 77], "last")[0]
        np.testing.assert_allclose(got, want, atol=1e-2)
        assert int(np.argmax(got)) == int(np.argmax(want))
        assert m.tokens == ids + [10, 20, 77]


def test_pair_check_takes_other_vocab_through_text(target_path, other_vocab_path):
    from localspec.models.pair import VocabInfo, check_pair

    e = Engine.load(target_path, other_vocab_path, n_ctx=256)
    try:
        assert e.draft_kind == "cross-vocab"
        none = VocabInfo("none", 0, -1, -1, False, False, [])
        with pytest.raises(IncompatibleDraftError, match="the draft has no tokenizer"):
            check_pair(e.target.vocab_info(), none)
    finally:
        e.close()


def test_pair_check_reports_first_difference():
    from localspec.models.pair import VocabInfo
    from localspec.models.pair import first_difference

    a = VocabInfo("bpe", 100, 1, 2, False, False, [b"t%d" % i for i in range(100)])
    assert first_difference(a, a) is None
    b = VocabInfo("bpe", 300, 1, 2, False, False, [b"t%d" % i for i in range(300)])
    assert "vocab sizes differ by 200" in first_difference(a, b)
    c = VocabInfo("spm", 100, 1, 2, False, False, a.token_text)
    assert "vocab type" in first_difference(a, c)
    d = VocabInfo("bpe", 100, 1, 3, False, False, a.token_text)
    assert "special tokens" in first_difference(a, d)
    t = list(a.token_text)
    t[50] = b"zz"
    assert "token 50 differs" in first_difference(a, VocabInfo("bpe", 100, 1, 2, False, False, t))
    t = list(a.token_text)
    t[3] = b"zz"  # ids below 5 are not compared (llama.cpp does the same)
    assert first_difference(a, VocabInfo("bpe", 100, 1, 2, False, False, t)) is None


def test_stop_string_and_max_tokens(engine, plain):
    full = engine.target.detokenize(plain[PROMPTS[0]])
    stop = full[30:34]
    r = engine.complete(engine.raw_prompt(PROMPTS[0]), GenConfig(method="lookup", max_tokens=N_EXACT, stop=[stop]))
    assert r.finish_reason == "stop"
    assert r.text == full[: full.index(stop)]
    r = engine.complete(engine.raw_prompt(PROMPTS[0]), GenConfig(method="draft", k=8, max_tokens=7))
    assert r.finish_reason == "length" and len(r.tokens) == 7 and r.tokens == plain[PROMPTS[0]][:7]


def test_text_assembler_utf8_and_stop_holdback():
    ta = TextAssembler(stops=["END"])
    euro = "€".encode()
    assert ta.push(euro[:1]) == ("", False)
    assert ta.push(euro[1:]) == ("€", False)
    assert ta.push(b"abE") == ("ab", False)  # 'E' may start 'END': held back
    assert ta.push(b"N") == ("", False)
    assert ta.push(b"Dxyz") == ("", True)
    assert ta.text == "€ab"
    ta = TextAssembler()
    assert ta.push(b"plain") == ("plain", False)


def test_stream_pieces_join_to_text(engine):
    pieces, fin = [], None
    for ev in engine.generate(engine.raw_prompt(PROMPTS[3]), GenConfig(method="lookup", max_tokens=60)):
        if isinstance(ev, Piece):
            pieces.append(ev)
        else:
            fin = ev
    assert isinstance(fin, Finished)
    assert "".join(p.text for p in pieces) == fin.text
    assert sum(p.drafted for p in pieces) == fin.stats.accepted


def test_multi_turn_reuses_kv_prefix(engine):
    msgs = [{"role": "user", "content": "the cat"}]
    p1 = engine.chat_prompt(msgs)
    r1 = engine.complete(p1, GenConfig(method="draft", k=4, max_tokens=20))
    msgs += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "and the dog"}]
    p2 = engine.chat_prompt(msgs)
    r2 = engine.complete(p2, GenConfig(method="draft", k=4, max_tokens=20))
    assert r2.stats.cached_prompt_tokens >= len(p1)
    # and the answer is what a cold engine gives
    cold = engine.complete([1], GenConfig(method="none", max_tokens=1))  # disturb the cache
    r3 = engine.complete(p2, GenConfig(method="none", max_tokens=20))
    assert r3.tokens == r2.tokens and cold.stats.cached_prompt_tokens <= 1


def test_context_full_ends_with_length(target_path):
    e = Engine.load(target_path, target_path, n_ctx=64)
    try:
        p = e.raw_prompt("the cat and the dog")
        r = e.complete(p, GenConfig(method="draft", k=8, max_tokens=500))
        assert r.finish_reason == "length"
        assert len(p) + len(r.tokens) == e.target.n_ctx + 1  # the pending last token needs no KV slot
        with pytest.raises(ContextOverflowError, match="ctx_size") as exc:  # the engine names the setting ...
            e.complete(e.raw_prompt("x " * 400), GenConfig())
        assert "use -c 1024 " in exc.value.worded({"ctx_size": "-c"})  # ... and the CLI words it as its flag
    finally:
        e.close()


def test_bad_configs(engine, target_path):
    with pytest.raises(UsageError):
        GenConfig(method="bogus")
    with pytest.raises(UsageError):
        GenConfig(k=-1)
    with pytest.raises(UsageError):
        GenConfig(k=1000)
    e = Engine.load(target_path, None, n_ctx=256)
    try:
        with pytest.raises(UsageError, match="draft model"):
            e.complete(e.raw_prompt("x"), GenConfig(method="draft"))
    finally:
        e.close()


def test_sampled_speculation_matches_plain_distribution(target_path, draft_path):
    """Temperature 1: the distribution of the first drafted position's token after a fixed prompt is the same with a
    low-acceptance draft as with plain sampling (chi-square on >= 1500 runs each)."""
    e = Engine.load(target_path, draft_path, n_ctx=256)
    try:
        prompt = e.raw_prompt("def f(x): return x")  # a spread-out next-token distribution
        n = 1500
        a, _, _ = second_tokens(e, prompt, "none", 0, n, p_min=0)
        b, _, _ = second_tokens(e, prompt, "draft", 10**6, n, p_min=0)
        assert_same_distribution(a, b)
    finally:
        e.close()


def test_exact_batch_probe_caps_k(target_path, plain):
    """k is capped so that verify batches are bit-identical to one-token decodes; the probe measures it."""
    from localspec.core.exactness import probe

    with Model(target_path, n_ctx=1024) as m:  # the engine below probes with the same context (and long prefix)
        best = probe(m, 9)
        assert 1 <= best <= 9
        ids = m.tokenize("the cat")
        m.decode(ids)
        assert m.tokens == ids  # the probe leaves the cache as it found it
    e = Engine.load(target_path, target_path, n_ctx=1024)
    try:
        assert e.exact_k(8) == min(8, best - 1)
        r = e.complete(e.raw_prompt(PROMPTS[0]), GenConfig(method="draft", k=8, max_tokens=40, p_min=0, exactness="bit"))
        assert max(r.stats.k_used) <= e.exact_k(8)
        assert r.stats.exactness == "bit" and r.stats.exactness_reason.startswith("bit: ")
        if e.exact_k(8) < 8:
            assert "k capped" in r.stats.reason
    finally:
        e.close()


def test_large_k_uncapped_still_exact_with_wide_margins(target_path, plain, monkeypatch):
    """LOCALSPEC_ALLOW_INEXACT=1 lifts the cap: big verify batches (k = 8) on the wide-margin test model
    still give plain decoding's tokens, exercising long rollbacks."""
    monkeypatch.setenv("LOCALSPEC_ALLOW_INEXACT", "1")
    e = Engine.load(target_path, target_path, n_ctx=1024)
    try:
        for p in PROMPTS:
            r = e.complete(e.raw_prompt(p), GenConfig(method="draft", k=8, max_tokens=N_EXACT, p_min=0))
            assert r.tokens == plain[p]
            assert r.stats.k_cap == 8 and r.stats.mean_accepted_length > 8
            assert r.stats.exactness == "lossless" and "LOCALSPEC_ALLOW_INEXACT" in r.stats.exactness_reason
        low = Engine.load(target_path, e.target.path.parent / "draft.gguf", n_ctx=1024)
        try:
            for p in PROMPTS:
                assert low.complete(low.raw_prompt(p), GenConfig(method="draft", k=8, max_tokens=N_EXACT, p_min=0)).tokens == plain[p]
                assert low.complete(low.raw_prompt(p), GenConfig(method="lookup", k=8, max_tokens=N_EXACT)).tokens == plain[p]
        finally:
            low.close()
    finally:
        e.close()


def test_exactness_levels_when_the_probe_answers_1(target_path, plain, monkeypatch):
    """A backend whose verify batches are never bit-identical (every GPU): `bit` falls back to plain decoding,
    `auto` speculates anyway at level lossless and says why, `lossless` never probes."""
    import localspec.core.exactness as ex

    calls = []
    monkeypatch.setattr(ex, "max_exact_batch", lambda model, upto: calls.append(upto) or 1)
    e = Engine.load(target_path, target_path, n_ctx=1024)
    try:
        prompt = e.raw_prompt(PROMPTS[0])
        auto = e.complete(prompt, GenConfig(method="draft", k=4, max_tokens=N_EXACT, p_min=0))
        assert auto.stats.exactness == "lossless" and auto.stats.k_cap == 4
        assert auto.stats.exactness_reason.startswith("lossless: bit-exact verify needs k <= 0")
        assert auto.stats.drafted > 0 and max(auto.stats.k_used) == 4
        assert auto.tokens == plain[PROMPTS[0]]  # wide margins: no near-tie for float order to flip
        bit = e.complete(prompt, GenConfig(method="draft", k=4, max_tokens=N_EXACT, p_min=0, exactness="bit"))
        assert bit.stats.exactness == "bit" and bit.stats.k_cap == 0 and bit.stats.drafted == 0
        assert bit.tokens == plain[PROMPTS[0]]
        n = len(calls)
        free = e.complete(prompt, GenConfig(method="lookup", k=6, max_tokens=20, exactness="lossless"))
        assert free.stats.exactness == "lossless" and free.stats.k_cap == 6 and len(calls) == n
    finally:
        e.close()


@pytest.mark.parametrize("answer, level, k_cap", [(2, "lossless", 8), (3, "bit", 2), (9, "bit", 8)])
def test_auto_exactness_keeps_bit_when_two_drafts_fit(target_path, monkeypatch, answer, level, k_cap):
    import localspec.core.exactness as ex

    monkeypatch.setattr(ex, "max_exact_batch", lambda model, upto: min(answer, upto))
    e = Engine.load(target_path, None, n_ctx=512)
    try:
        k, got, why = e.exactness_for(GenConfig(method="lookup", k=8))
        assert (k, got) == (k_cap, level) and why.startswith(level + ": ")
        assert e.exactness_for(GenConfig(method="lookup", k=1))[1] == ("bit" if answer >= 2 else "lossless")
        assert e.exactness_for(GenConfig(method="none", k=8))[:2] == (0, "bit")
    finally:
        e.close()


def test_exactness_is_validated():
    with pytest.raises(UsageError, match="exactness"):
        GenConfig(exactness="exact")
    assert GenConfig().exactness == "auto"


def test_probe_records_deviation_per_batch_size(target_path, monkeypatch, tmp_path):
    """The probe measures, per batch size, the largest |Δlogit| between batched rows and one-token decodes (0 up
    to the exact batch), caches it with the exact batch, and re-measures an entry that holds the exact batch alone."""
    import json

    import localspec.core.exactness as ex
    from localspec.core.probe_memo import CACHE_FILE

    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path))
    with Model(target_path, n_ctx=1024) as m:
        got = ex.measure(m, 6)
        best, dev = got["batch"], got["deviation"]
        assert 1 <= best <= 6 and set(dev) == {2, 3, 4, 5, 6}
        assert all(dev[b] == 0.0 for b in range(2, best + 1))
        if best < 6:
            assert dev[best + 1] > 0.0
        assert all(0.0 <= v < 1.0 for v in dev.values())
        calls = []
        real = ex.measure
        monkeypatch.setattr(ex, "measure", lambda model, upto: calls.append(upto) or real(model, upto))
        assert ex.deviation(m, 6) == dev and ex.max_exact_batch(m, 6) == best and calls == [6]  # measured once
        db = json.loads((tmp_path / CACHE_FILE).read_text())
        (key, entry), = db.items()
        assert entry["batch"] == best and entry["model"] == str(target_path.resolve()) and entry["long_prefix"] is True
        assert [p["deviation"] for p in ex.cached_probes()] == [dev]
        (tmp_path / CACHE_FILE).write_text(json.dumps({key: best}))  # an entry with the exact batch alone
        assert ex.deviation(m, 6) == dev and calls == [6, 6]
        assert not [p for p in tmp_path.iterdir() if p.name not in (CACHE_FILE, "locks")]  # no temp files left behind


def test_cache_writes_are_atomic(monkeypatch, tmp_path):
    """A failed write leaves the previous file whole (a temp file, then os.replace) and no temp file behind."""
    from localspec.store import cachefile

    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path))
    cachefile.write_json("x.json", {"a": 1})
    assert cachefile.read_json("x.json") == {"a": 1}

    def broken(src, dst, **kw):  # write_at passes the folder descriptor (src_dir_fd, dst_dir_fd)
        raise OSError("disk full")

    monkeypatch.setattr(cachefile.os, "replace", broken)
    cachefile.write_json("x.json", {"a": 2, "b": "x" * 10000})
    assert cachefile.read_json("x.json") == {"a": 1}
    assert [p.name for p in tmp_path.iterdir() if p.name != "locks"] == ["x.json"]


def test_gpu_layers_default_to_all_when_there_is_a_gpu(target_path, monkeypatch):
    """Unset gpu layers resolve at load time: all (-1) when llama.cpp has a GPU device, else 0; a given count wins."""
    from localspec.llama import ggml
    from localspec.llama import sysinfo
    assert sysinfo.supports_gpu_offload() == any(d["type"] in ("gpu", "igpu") for d in ggml.devices())
    for has_gpu, want in ((False, 0), (True, -1)):
        monkeypatch.setattr(sysinfo, "supports_gpu_offload", lambda: has_gpu)
        e = Engine.load(target_path, target_path, n_ctx=256)
        try:
            assert e.target.n_gpu_layers == want and e.draft.n_gpu_layers == want
        finally:
            e.close()
    e = Engine.load(target_path, target_path, n_ctx=256, gpu_layers=0, draft_gpu_layers=3)
    try:
        assert e.target.n_gpu_layers == 0 and e.draft.n_gpu_layers == 3
    finally:
        e.close()


def test_auto_exactness_leaves_the_bit_cap_when_a_bigger_k_pays(target_path, monkeypatch):
    """`auto` does not stay at k<=2 (the bit cap) where a bigger k pays: the controller moves to lossless once its
    cost model says a k above the cap pays, says why, and the output stays the target's.
    The drafter is a free oracle (it proposes plain decoding's own continuation), so acceptance is certain."""
    import localspec.core.exactness as ex
    from localspec.drafters.base import Drafter, Proposal

    monkeypatch.setattr(ex, "max_exact_batch", lambda model, upto: min(3, upto))  # bit cap: k <= 2
    e = Engine.load(target_path, None, n_ctx=1024)
    try:
        prompt = e.raw_prompt(PROMPTS[0])
        plain_tokens = e.complete(prompt, GenConfig(method="none", max_tokens=120)).tokens

        class Oracle(Drafter):
            name = "oracle"

            def cost(self):
                return 0.0

            def propose(self, context, k, sp, rng):
                done = len(context) - len(prompt)
                return Proposal(plain_tokens[done:done + k])

        oracle = Oracle()
        monkeypatch.setattr(e, "drafters_for", lambda cfg, method: {"oracle": oracle})
        monkeypatch.setattr(e, "verify_costs", lambda upto: {b: 1.0 for b in range(1, upto + 1)})  # a GPU's curve
        r = e.complete(prompt, GenConfig(method="auto", k=8, max_tokens=120))
        assert r.tokens == plain_tokens
        assert r.stats.exactness == "lossless" and r.stats.exactness_reason.startswith("lossless: k=")
        assert "bit cap k<=2" in r.stats.exactness_reason and max(r.stats.k_used) > 2 and r.stats.k_cap == 8
        bit = e.complete(prompt, GenConfig(method="auto", k=8, max_tokens=120, exactness="bit"))
        assert bit.stats.exactness == "bit" and max(bit.stats.k_used) <= 2 and bit.tokens == plain_tokens
    finally:
        e.close()


def test_every_drafting_step_counts_its_tokens_to_the_source_that_drafted_them(engine):
    """auto picks among sources step by step; each step's drafted and accepted tokens go to the one that drafted
    them, so the per-source counts (bench, /metrics, the chat's details, run --json's `sources`) add up to the
    totals."""
    from localspec.core.report import figures

    for method in ("lookup", "draft"):
        cfg = GenConfig(method=method, k=4, max_tokens=N_EXACT)
        st = engine.complete(engine.raw_prompt(PROMPTS[0]), cfg).stats
        assert st.drafted > 0
        assert dict(st.drafted_by) == {method: st.drafted} and dict(st.accepted_by) == {method: st.accepted}
        assert all(None not in v for v in st.by_source().values())
        assert figures(st)["sources"] == {method: {"steps": st.drafting_steps, "drafted": st.drafted,
                                                   "accepted": st.accepted,
                                                   "acceptance": round(st.accepted / st.drafted, 4)}}


def test_a_single_request_is_stepped_by_the_batch_scheduler_as_a_batch_of_one(engine, plain, monkeypatch):
    """run, chat and bench decode through BatchEngine.step (one loop for one request and for many): every target
    pass of a generation is one of the scheduler's steps, and its answer is plain decoding's."""
    from localspec.core.backend import OwnContext
    from localspec.core.batch import BatchEngine

    steps: list = []
    step = BatchEngine.step

    def counted(self):
        steps.append((self.n_slots, type(self.ms)))
        return step(self)

    monkeypatch.setattr(BatchEngine, "step", counted)
    p = PROMPTS[0]
    r = engine.complete(engine.raw_prompt(p), GenConfig(method="lookup", k=4, max_tokens=N_EXACT, exactness="bit"))
    assert r.tokens == plain[p]
    assert set(steps) == {(1, OwnContext)}  # one slot: the target's own context
    # the steps that decoded: one per target pass; the last step found the answer's end and decoded nothing
    assert len(steps) - 1 == r.stats.target_passes > 0


def test_a_generation_left_mid_way_has_final_stats_and_the_next_one_starts(engine, plain):
    """A caller that stops reading (Ctrl-C, a closed stream) leaves the stats settled and the target free: the
    next generation on the same engine runs and equals plain decoding."""
    p = PROMPTS[1]
    it = engine.generate(engine.raw_prompt(p), GenConfig(method="lookup", k=4, max_tokens=N_EXACT))
    got = [next(it) for _ in range(3)]
    assert all(isinstance(ev, Piece) for ev in got)
    it.close()
    st = engine.last_stats
    assert not st.running and st.elapsed_s > 0
    r = engine.complete(engine.raw_prompt(p), GenConfig(method="none", max_tokens=N_EXACT))
    assert r.tokens == plain[p]


def test_a_cancelled_request_stops_its_prompt_between_chunks(engine):
    """A caller that gives up while a long prompt is decoded (a client gone mid-prefill) stops it at the next n_batch
    chunk: the request ends cancelled with no token, and the chunks decoded stay in the cache for a retry."""
    import threading

    from localspec.core.engine import GenConfig

    target = engine.target
    prompt = (engine.raw_prompt("the cat and the dog and a x = y + 1 ") * 80)[:target.n_batch * 2 - 100]
    assert len(prompt) > target.n_batch
    target.truncate(0)
    gone = threading.Event()
    gone.set()
    fin = engine.respond(prompt, GenConfig(method="none", max_tokens=8), cancel=gone).result()
    assert fin.finish_reason == "cancelled" and fin.tokens == []
    assert len(target.tokens) == target.n_batch  # the first chunk, kept
    again = engine.complete(prompt, GenConfig(method="none", max_tokens=8))
    assert again.stats.cached_prompt_tokens == target.n_batch and len(again.tokens) == 8
