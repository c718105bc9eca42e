"""Continuous batching (core/batch.py): several requests in one llama_decode give the texts they give alone."""

import functools

import numpy as np
import pytest

from conftest import PROMPTS, check_cancel_mid_batch, require_exact_batching
from helpers import alone, gen_config
from localspec.core.batch import BatchEngine
from localspec.core.engine import Engine, Finished, Piece
from localspec.errors import UsageError

N = 120
cfg_for = functools.partial(gen_config, max_tokens=N)


def test_the_probe_says_batching_is_exact_on_the_tiny_model(batch, exact_batching):
    require_exact_batching(exact_batching)
    exact, why = batch.probe()
    assert exact, why


def test_the_probe_sees_a_longer_cache_beside_a_row_change_it(engine):
    """On a 2-core AMD EPYC with AVX512-BF16, a row decoded beside another request whose cache is longer (requests
    that started at different times: every pass of a running batch) differs from its one-token decoding (BF16-KV
    flash attention spans the longest cache of the pass). The probe checks that case apart from rollbacks: its verdict
    must be what a direct decode shows, on any CPU."""
    import numpy as np

    from localspec.core.batch_probe import probe_lengths
    from localspec.llama.multiseq import MultiSeq

    ms = MultiSeq(engine.target, 2)
    try:
        toks = engine.target.tokenize("def area(w, h): return w * h", add_special=False)[:8]
        ms.clear()
        alone = [np.array(ms.decode([(0, [t], [0])])[0][0], copy=True) for t in toks]
        ms.clear()
        for t in toks:
            ms.decode([(1, [t], [])])  # the other request is a whole prompt ahead
        beside = [np.array(ms.decode([(1, [t], []), (0, [t], [0])])[1][0], copy=True) for t in toks]
        same = all(np.array_equal(a, b) for a, b in zip(alone, beside))
        assert probe_lengths(ms, toks) == same
    finally:
        ms.close()


@pytest.mark.parametrize("method", ["none", "lookup", "auto"])
def test_four_at_once_equal_four_one_after_another(engine, batch, method):
    prompts = PROMPTS
    seq = [alone(engine, p, cfg_for(method)) for p in prompts]
    steps0 = batch.steps
    got = batch.generate_all([(engine.raw_prompt(p), cfg_for(method)) for p in prompts])
    for a, b in zip(seq, got):
        assert b.tokens == a.tokens
        assert b.text == a.text
        assert b.finish_reason == a.finish_reason
        assert b.stats.completion_tokens == len(b.tokens)
        assert b.stats.exactness in ("bit", "lossless") and b.stats.exactness_reason
    # they really shared decodes: fewer steps than the tokens of all four
    assert batch.steps - steps0 < sum(len(r.tokens) for r in got)


def test_speculation_happens_inside_the_batch(engine, batch):
    # a prompt that repeats the model's own answer: prompt lookup finds it again while the answer repeats
    p = engine.raw_prompt(PROMPTS[0])
    own = alone(engine, PROMPTS[0], cfg_for("none", max_tokens=40)).tokens
    prompt = p + own + p + own + p
    cfg = lambda: cfg_for("lookup", k=4, max_tokens=60, exactness="lossless")
    seq = engine.complete(list(prompt), cfg())
    assert seq.stats.accepted > 0
    got = batch.generate_all([(list(prompt), cfg()), (engine.raw_prompt(PROMPTS[1]), cfg())])
    assert got[0].tokens == seq.tokens
    st = got[0].stats
    assert st.drafted > 0 and st.accepted > 0
    assert st.method_used["lookup"] > 0
    assert st.target_passes < st.completion_tokens  # some passes emitted more than one token


def _start(batch, engine, prompts, cfgs, cancels=None):
    results, pieces = {}, {}
    for i, (p, c) in enumerate(zip(prompts, cfgs)):
        pieces[i] = []

        def sink(ev, i=i):
            if isinstance(ev, Finished):
                results[i] = ev
            elif isinstance(ev, Piece):
                pieces[i].append(ev.text)
        batch.add(engine.raw_prompt(p), c, cancel=(cancels or {}).get(i), sink=sink)
    return results, pieces


def test_a_request_cancelled_mid_batch_leaves_the_others_unchanged(engine, batch):
    check_cancel_mid_batch(engine, batch, lambda: [(p, cfg_for("lookup")) for p in PROMPTS], 12)


def test_a_long_prompt_joining_midway_does_not_corrupt_the_running_ones(engine, batch):
    long_prompt = " ".join(PROMPTS * 12)  # hundreds of tokens: prefilled 16 a step beside the others
    assert len(engine.raw_prompt(long_prompt)) > 8 * batch.prefill_chunk
    seq = [alone(engine, p, cfg_for("lookup")) for p in PROMPTS[:3]]
    late = alone(engine, long_prompt, cfg_for("lookup", max_tokens=40))
    results, _ = _start(batch, engine, PROMPTS[:3], [cfg_for("lookup") for _ in range(3)])
    for _ in range(5):
        batch.step()
    r2, _ = _start(batch, engine, [long_prompt], [cfg_for("lookup", max_tokens=40)])
    others = [r for r in batch.runs if r is not None and not r.prefill]
    joining = [r for r in batch.runs if r is not None and r.prefill]
    assert len(others) == 3 and len(joining) == 1
    before = [len(r.out) for r in others]
    for _ in range(3):
        batch.step()
    assert joining[0].prefill  # still prefilling, 16 tokens a step ...
    assert all(len(r.out) > n for r, n in zip(others, before))  # ... while the others kept generating
    while batch.active:
        batch.step()
    for i in range(3):
        assert results[i].tokens == seq[i].tokens
    assert r2[0].tokens == late.tokens


def test_a_continued_conversation_reuses_its_slot_cache(engine, batch):
    first = batch.generate_all([(engine.raw_prompt(PROMPTS[2]), cfg_for("none", max_tokens=20))])[0]
    again = engine.raw_prompt(PROMPTS[2]) + first.tokens
    got = batch.generate_all([(again, cfg_for("none", max_tokens=20))])[0]
    assert got.stats.cached_prompt_tokens >= len(again) - 2
    assert got.tokens == alone(engine, PROMPTS[2], cfg_for("none", max_tokens=40)).tokens[20:40]


def test_what_takes_the_single_sequence_path(engine, batch):
    assert batch.single_reason(cfg_for("lookup")) == ""
    assert batch.single_reason(cfg_for("auto")) == ""
    assert batch.single_reason(cfg_for("draft")) == ""  # the draft model drafts in the batch (test_batch_draft.py)
    c = cfg_for("none")
    c.constraint = object()
    # a grammar, logprobs and logit_bias are a Generation's, wherever its rows are decoded
    assert batch.single_reason(c) == ""
    assert batch.single_reason(cfg_for("lookup", logprobs=2)) == ""
    assert batch.single_reason(cfg_for("lookup", logit_bias={5: -100.0})) == ""


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "n"], "additionalProperties": False}


def mixed(engine):
    """Four requests as agents send them: a JSON schema, a forced tool call, logprobs, and a plain one with a bias.
    Each call gives new configs (a grammar is consumed by the run that uses it)."""
    from localspec.server.grammar import constraint_for
    from localspec.server.tool_grammar import choice_grammar

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}}]
    schema = constraint_for({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}, engine.target)
    tool = choice_grammar(tools, {"type": "function", "function": {"name": "get_weather"}}, None, fmt="json")
    from localspec.server.grammar import Grammar

    return [
        (PROMPTS[0], cfg_for("lookup", max_tokens=60, constraint=schema)),
        (PROMPTS[1], cfg_for("auto", max_tokens=60, constraint=Grammar(tool, engine.target))),
        (PROMPTS[2], cfg_for("auto", max_tokens=40, logprobs=3)),
        (PROMPTS[3], cfg_for("lookup", max_tokens=40, logit_bias={5: -100.0, 7: 5.0})),
    ]


def test_grammar_tools_logprobs_and_bias_batch_together_and_answer_as_alone(engine, batch):
    import json

    seq = [alone(engine, p, c) for p, c in mixed(engine)]
    seen = []  # the sequences of each decode
    decode = batch.ms.decode

    def recording(parts, **kw):
        seen.append({p[0] for p in parts})
        return decode(parts, **kw)

    batch.ms.decode = recording
    try:
        got = batch.generate_all([(engine.raw_prompt(p), c) for p, c in mixed(engine)])
    finally:
        batch.ms.decode = decode
    assert any(len(s) == 4 for s in seen)  # all four in one decode
    for a, b in zip(seq, got):
        assert b.tokens == a.tokens and b.text == a.text and b.finish_reason == a.finish_reason
    assert set(json.loads(got[0].text)) == {"name", "n"}  # the grammar held it
    assert "get_weather" in got[1].text
    assert 5 not in got[3].tokens


def test_logprobs_in_a_batch_are_the_rows_that_emitted_each_token(engine, batch):
    from localspec.core.engine import Piece

    cfg = cfg_for("lookup", max_tokens=30, logprobs=3)
    want = [ev for ev in engine.generate(engine.raw_prompt(PROMPTS[2]), cfg) if isinstance(ev, Piece) and ev.token >= 0]
    pieces = []
    batch.add(engine.raw_prompt(PROMPTS[2]), cfg, sink=lambda ev: pieces.append(ev) if isinstance(ev, Piece) else None)
    for p in PROMPTS[:3]:
        if p != PROMPTS[2]:
            batch.add(engine.raw_prompt(p), cfg_for("none", max_tokens=30))
    while batch.active:
        batch.step()
    got = [ev for ev in pieces if ev.token >= 0]
    assert [ev.token for ev in got] == [ev.token for ev in want]
    for a, b in zip(got, want):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_a_grammar_request_cancelled_mid_batch_leaves_the_others_unchanged(engine, batch):
    check_cancel_mid_batch(engine, batch, lambda: mixed(engine), 6, which=0)


def test_a_bias_that_leaves_no_token_the_grammar_allows_fails_that_request_only(engine, batch):
    """The request's own error reaches its sink; the others in the batch finish as alone."""
    from localspec.errors import SettingError
    from localspec.server.grammar import constraint_for

    con = constraint_for({"type": "json_object"}, engine.target)
    allowed = np.flatnonzero(con.allowed()[:engine.target.n_vocab])
    bad = cfg_for("none", max_tokens=20, constraint=con, logit_bias={int(t): -100.0 for t in allowed})
    plain = alone(engine, PROMPTS[1], cfg_for("none", max_tokens=20))
    events = {0: [], 1: []}
    batch.add(engine.raw_prompt(PROMPTS[0]), bad, sink=events[0].append)
    batch.add(engine.raw_prompt(PROMPTS[1]), cfg_for("none", max_tokens=20), sink=events[1].append)
    while batch.active:
        batch.step()
    assert len(events[0]) == 1 and isinstance(events[0][0], SettingError) and "logit_bias" in str(events[0][0])
    assert events[1][-1].tokens == plain.tokens


def test_where_batching_is_not_bit_exact_batched_requests_say_lossless(engine, target_path, monkeypatch):
    b = BatchEngine(engine, 2)
    try:
        monkeypatch.setattr(b, "_probe", lambda: (False, "a row's logits change when 1 rows of another request "
                                                        "share its batch"))
        r = b.generate_all([(engine.raw_prompt(PROMPTS[0]), cfg_for("none", exactness="bit"))])[0]
        assert r.stats.exactness == "lossless"
        assert "batched" in r.stats.exactness_reason and "change" in r.stats.exactness_reason
    finally:
        b.close()


def test_one_unified_cache_means_lossless(engine):
    """A shared KV cache leaves a request's cells out of position order after the others' rollbacks: at bit the
    batched requests say lossless, and why."""
    b = BatchEngine(engine, 2, unified=True)
    try:
        exact, why = b.probe()
        assert not exact and "position order" in why
        r = b.generate_all([(engine.raw_prompt(PROMPTS[0]), cfg_for("none", exactness="bit"))] * 2)
        assert all(x.stats.exactness == "lossless" and "position order" in x.stats.exactness_reason for x in r)
        assert r[0].tokens == alone(engine, PROMPTS[0], cfg_for("none")).tokens  # wide margins: same text
    finally:
        b.close()


def test_bit_requests_in_separate_streams_stay_bit(engine, batch, exact_batching):
    require_exact_batching(exact_batching)
    r = batch.generate_all([(engine.raw_prompt(p), cfg_for("none", exactness="bit")) for p in PROMPTS])
    assert all(x.stats.exactness == "bit" for x in r)
    assert [x.tokens for x in r] == [alone(engine, p, cfg_for("none", exactness="bit")).tokens for p in PROMPTS]


def test_a_recurrent_target_that_cannot_roll_back_is_refused_so_serve_keeps_one_at_a_time(tmp_path, monkeypatch):
    """A recurrent target batches (tests/test_batch_recurrent.py) where its state rolls back; where it cannot
    (rollback none), its requests decode plainly, one at a time."""
    from tinymodels import write_mamba

    monkeypatch.setenv("LOCALSPEC_ROLLBACK", "none")
    e = Engine.load(write_mamba(tmp_path / "mamba.gguf", 3), n_ctx=512)
    try:
        with pytest.raises(UsageError, match="recurrent"):
            BatchEngine(e, 2)
    finally:
        e.close()


def inexact_at_full_batch(self):
    """The probe's verdict on a 2-core CPU with repacked Q4_K weights: 2 and 3 requests x 1 row share a pass
    bit-identically, 4 x 1 does not."""
    from localspec.core.batch_probe import ProbeResult

    return ProbeResult(False, "passes of 4 x 1 rows (requests x rows each) are not bit-identical to one-token "
                       "decoding", {(2, 1): True, (3, 1): True, (4, 1): False}, {}, blanket=False)


def test_kv_layout_auto_takes_one_unified_cache_where_a_full_batch_is_not_bit_exact(engine, monkeypatch):
    """Where a full batch (every slot x 1 row) is not bit-identical anyway, --kv-layout auto puts the slots in one
    unified KV cache (a step's drafted rows then join its one pass): requests say lossless and why, and give the
    texts they give alone (the tiny model's margins are wide)."""
    monkeypatch.setattr(BatchEngine, "_probe", inexact_at_full_batch)
    b = BatchEngine(engine, 4, layout="auto")
    try:
        assert b.layout == "auto" and not b.ms.unified
        b.probe()
        assert b.layout == "unified" and b.ms.unified and "unified" in b.layout_why
        got = b.generate_all([(engine.raw_prompt(p), cfg_for("lookup")) for p in PROMPTS])
        for p, r in zip(PROMPTS, got):
            assert r.tokens == alone(engine, p, cfg_for("lookup")).tokens
            assert r.stats.exactness == "lossless" and "one KV cache" in r.stats.exactness_reason
    finally:
        b.close()


def test_kv_layout_auto_keeps_separate_streams_where_they_keep_bit_or_nothing_drafts(engine, monkeypatch, exact_batching):
    require_exact_batching(exact_batching)
    b = BatchEngine(engine, 4, layout="auto")  # the tiny F16 model: every shape bit-identical
    try:
        assert b.probe()[0] and b.layout == "split" and "bit-identical" in b.layout_why
    finally:
        b.close()
    monkeypatch.setattr(BatchEngine, "_probe", inexact_at_full_batch)
    b = BatchEngine(engine, 4, layout="auto", speculative=False)  # plain decoding: every slot one row anyway
    try:
        b.probe()
        assert b.layout == "split" and "drafts no rows" in b.layout_why
    finally:
        b.close()
    b = BatchEngine(engine, 2, layout="unified")
    try:
        assert b.layout == "unified"
    finally:
        b.close()
    with pytest.raises(UsageError):
        BatchEngine(engine, 2, layout="shared")


@pytest.mark.parametrize("layout", ["split", "unified"])
def test_a_new_request_takes_a_shared_prefix_from_another_slots_cache(engine, layout):
    # chat requests share the template's system prompt: a request joining while another runs (so it takes another
    # slot) decodes only what differs, the prefix copied from the running slot's cache, and gives its text alone
    head = " ".join(PROMPTS * 2)  # a long shared start, as a system prompt
    first, second = head + " and then", head + " or else"
    cfg = lambda: cfg_for("lookup", max_tokens=30, exactness="lossless")
    seq = [alone(engine, p, cfg()) for p in (first, second)]
    shared = len(engine.raw_prompt(head))
    b = BatchEngine(engine, 4, prefill_chunk=16, layout=layout)
    try:
        results, _ = _start(b, engine, [first], [cfg()])
        while b.runs[0] is not None and b.runs[0].prefill:
            b.step()
        b.step()
        got, _ = _start(b, engine, [second], [cfg()])
        joined = [r for r in b.runs if r is not None and r.prefill]
        assert joined and joined[0].seq != 0  # it took another slot ...
        assert len(joined[0].prefill) <= len(engine.raw_prompt(second)) - shared + 1  # ... with the prefix cached
        while b.active:
            b.step()
    finally:
        b.close()
    assert got[0].stats.cached_prompt_tokens >= shared - 1
    assert results[0].tokens == seq[0].tokens
    assert got[0].tokens == seq[1].tokens


def test_a_slow_prefill_takes_smaller_chunks_beside_running_requests(engine, monkeypatch):
    """Where the machine prefills slowly (Qwen 1.5B on 2 cores: ~30 tokens/s, so a 256-token chunk would hold a
    running answer's next token back 8.5 s), a prompt joining beside generating requests decodes only what fits
    PREFILL_STEP_S at the measured rate (at least PREFILL_MIN); alone it takes the whole chunk. Texts unchanged."""
    from localspec.core import batch as B

    monkeypatch.setattr(B, "PREFILL_STEP_S", 1e-9, raising=False)  # any measured rate is "slow": the floor, PREFILL_MIN
    long_prompt = " ".join(PROMPTS * 12)
    cfg = lambda n: cfg_for("lookup", max_tokens=n)  # noqa: E731
    first = " ".join(PROMPTS)  # decoded alone: the prefill rate is measured on it
    seq = [alone(engine, first, cfg(60)), alone(engine, long_prompt, cfg(10))]
    b = BatchEngine(engine, 4, prefill_chunk=64)
    try:
        chunks = []  # (prompt rows, generating rows) per decode
        decode = b.ms.decode

        def counting(parts, copy=True):
            gen = [len(t) for s, t, _ in parts if b.runs[s] is not None and not b.runs[s].prefill]
            chunks.append((sum(len(t) for _, t, _ in parts) - sum(gen), len(gen)))
            return decode(parts, copy)
        b.ms.decode = counting
        results, _ = _start(b, engine, [first], [cfg(60)])
        b.step()  # its prompt alone
        b.step()
        r2, _ = _start(b, engine, [long_prompt], [cfg(10)])
        while b.active:
            b.step()
    finally:
        b.close()
    beside = [p for (p, g), nxt in zip(chunks, chunks[1:] + [(0, 0)]) if p and (g or nxt[1])]
    assert beside and max(beside) == 16  # beside the running request: the floor (PREFILL_MIN), not 64
    assert results[0].tokens == seq[0].tokens and r2[0].tokens == seq[1].tokens


def test_the_probe_is_cached_per_model_file_and_llama_cpp_build(target_path, tmp_path, monkeypatch):
    """probe(cache=True) (what the server runs before it says ready) decodes once per model file, build and batch
    settings; a changed model file or another build probes again, and doctor's list of probes is not confused."""
    import os
    import shutil

    from localspec.core import exactness as X
    from localspec.core import probe_memo

    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    shutil.copy(target_path, model)
    probes = []
    real = BatchEngine._probe
    monkeypatch.setattr(BatchEngine, "_probe", lambda self: probes.append(1) or real(self))

    def probed(n_slots=4):
        e = Engine.load(model, n_ctx=1024)
        b = BatchEngine(e, n_slots)
        try:
            cached = b.probe_cached()
            res = b.probe_result(cache=True)
            return cached, (res.exact, res.why, res.shapes, res.beside_prompt, res.blanket)
        finally:
            b.close()
            e.close()

    cached, first = probed()
    assert not cached and len(probes) == 1
    cached, again = probed()
    assert cached and again == first and len(probes) == 1  # from the cache, the same findings
    assert not probed(3)[0] and len(probes) == 2  # other batch settings: their own verdict
    build = probe_memo.this_build
    monkeypatch.setattr(probe_memo, "this_build", lambda: build() + "-rebuilt")
    assert not probed()[0] and len(probes) == 3
    monkeypatch.setattr(probe_memo, "this_build", build)
    st = os.stat(model)
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the model file replaced
    assert not probed()[0] and len(probes) == 4
    assert probed()[0] and len(probes) == 4
    assert all("exact" not in p for p in X.cached_probes())
