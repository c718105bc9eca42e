"""Draft heads in batch slots (core/batch_heads.py): a request with --method eagle3, dflash (a DFlash or a DSpark head)
or mtp decodes beside plain and prompt-lookup requests, in the same batched steps, and answers what it answers alone
on the single-sequence engine, with its head's drafts accepted; a request that joins or is cancelled mid-way leaves it
unchanged. The slot's head reads that slot's rows of each batched decode (llama/taps.SeqTap)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from tinyheads import (PROMPTS, write_bigram_target, write_dflash, write_dspark, write_eagle3, write_glm4moe_mtp)
from helpers import recording_decodes
from tinymodels import write_model

N = 40
HEADS = {  # method -> (the head's --method, its k)
    "eagle3": ("eagle3", 3),
    "dflash": ("dflash", 4),
    "dspark": ("dflash", 8),
    "mtp": ("mtp", 4),
}


@pytest.fixture(autouse=True)
def _no_cost_calibration(monkeypatch):
    """These tests check outputs, not speed: no verify-cost timing."""
    monkeypatch.setenv("LOCALSPEC_NO_COST_CALIBRATION", "1")


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("batch-heads")


@pytest.fixture(scope="module")
def files(heads_dir) -> dict:
    """kind -> (target, head file or None): agreeing heads on the bigram target (tests/tinyheads.py)."""
    bigram = write_bigram_target(heads_dir / "bigram.gguf", 7)
    return {
        "eagle3": (bigram, write_eagle3(heads_dir / "eagle3.gguf", 3, agree_with=7)),
        "dflash": (bigram, write_dflash(heads_dir / "dflash.gguf", 3, agree_with=7)),
        "dspark": (bigram, write_dspark(heads_dir / "dspark.gguf", 3, agree_with=7, wrong=0.2)),
        "mtp": (write_glm4moe_mtp(heads_dir / "glm-mtp.gguf", 7), None),
    }


def load(files, kind):
    from localspec.core.engine import Engine

    target, head = files[kind]
    e = Engine.load(target, head, n_ctx=512)
    assert HEADS[kind][0] in e.heads, e.heads_unavailable
    return e


def head_cfg(kind, **kw):
    from localspec.core.engine import GenConfig

    method, k = HEADS[kind]
    return GenConfig(**{"method": method, "k": k, "max_tokens": N, "p_min": 0.0, "exactness": "lossless", **kw})


def other_cfg(method, **kw):
    from localspec.core.engine import GenConfig

    return GenConfig(**{"method": method, "k": 4, "max_tokens": N, "exactness": "lossless", **kw})


def fresh_alone(files, kind, prompt, cfg):
    """The request alone on a newly loaded engine's single-sequence path (no earlier request's cache)."""
    e = load(files, kind)
    try:
        return e.complete(e.raw_prompt(prompt), cfg)
    finally:
        e.close()


def decodes(batch):
    """Per batched decode while the block runs: the slots whose verify rows (not a prompt chunk) it held."""
    def generating(parts):
        return {p[0] for p in parts} & {r.seq for r in batch.runs if r is not None and not r.prefill}

    return recording_decodes(batch.ms, generating)


def run_all(batch, engine, requests, *, cancel_at=None, join=None):
    """Add `requests` ((prompt, cfg) each) and step until all end. cancel_at: (index, step) cancels that request after
    that many steps; join: (step, (prompt, cfg)) adds a request then. Returns the Finished per request, in order."""
    from localspec.core.engine import Finished

    results, cancels = {}, {}

    def add(i, prompt, cfg):
        stop = cancels[i] = threading.Event()
        batch.add(engine.raw_prompt(prompt), cfg, cancel=stop,
                  sink=lambda ev, i=i: results.__setitem__(i, ev) if isinstance(ev, Finished) else None)

    for i, (p, c) in enumerate(requests):
        add(i, p, c)
    n = 0
    while batch.active:
        batch.step()
        n += 1
        if cancel_at is not None and n == cancel_at[1]:
            cancels[cancel_at[0]].set()
        if join is not None and n == join[0]:
            add(len(requests), *join[1])
    return [results[i] for i in sorted(results)]


@pytest.fixture(scope="module", params=list(HEADS))
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def engine(files, kind):
    e = load(files, kind)
    yield e
    e.close()


@pytest.fixture(scope="module")
def batch(engine):
    from localspec.core.batch import BatchEngine

    b = BatchEngine(engine, 3, prefill_chunk=16)
    yield b
    b.close()


def test_the_head_batches(batch, kind):
    assert batch.single_reason(head_cfg(kind)) == ""


def test_a_head_request_decodes_beside_plain_and_lookup_requests_and_answers_as_alone(files, kind, engine, batch):
    requests = [(PROMPTS[0], head_cfg(kind)), (PROMPTS[1], other_cfg("lookup")), (PROMPTS[2], other_cfg("none"))]
    seq = [engine.complete(engine.raw_prompt(p), c) for p, c in requests]
    fresh = fresh_alone(files, kind, PROMPTS[0], head_cfg(kind))
    with decodes(batch) as seen:
        got = run_all(batch, engine, [(PROMPTS[0], head_cfg(kind)), (PROMPTS[1], other_cfg("lookup")),
                                      (PROMPTS[2], other_cfg("none"))])
    for a, b in zip(seq, got):
        assert b.tokens == a.tokens and b.text == a.text and b.finish_reason == a.finish_reason
    st = got[0].stats
    assert st.method_used[HEADS[kind][0]] > 0 and st.accepted > 0  # the slot's head drafted, and was right
    # its drafts are the ones it makes alone: it read its own slot's hidden states, not another slot's
    assert (st.drafted, st.accepted) == (fresh.stats.drafted, fresh.stats.accepted)
    assert sum(1 for d in seen if d == {0, 1, 2}) >= 5  # the three verified in the same decodes, step after step


def test_auto_in_a_slot_drafts_with_the_head_too(kind, engine, batch):
    """method auto offers the engine's draft heads in a slot as it does alone (beside prompt lookup and the suffix
    cache), and answers as alone."""
    method = HEADS[kind][0]
    cfg = lambda: head_cfg(kind, method="auto")
    alone = engine.complete(engine.raw_prompt(PROMPTS[1]), cfg())
    seq = batch.add(engine.raw_prompt(PROMPTS[1]), cfg())
    batch.add(engine.raw_prompt(PROMPTS[0]), other_cfg("lookup"))
    run = batch.runs[seq]
    assert method in run.policy.drafters and "lookup" in run.policy.drafters
    head = batch.heads.active[seq][method]
    calls = head.hook_calls
    while batch.active:
        batch.step()
    assert run.out == alone.tokens
    assert head.hook_calls > calls  # it read the slot's rows of every decode, whichever drafter the step used
    assert "auto speculates with prompt lookup" not in run.stats.reason


def test_a_request_joining_midway_leaves_the_head_slot_unchanged(files, kind, engine, batch):
    long_prompt = " ".join(PROMPTS * 4)  # prefilled 16 tokens a step beside the head slot's verify rows
    alone_head = fresh_alone(files, kind, PROMPTS[2], head_cfg(kind))
    late = engine.complete(engine.raw_prompt(long_prompt), other_cfg("lookup"))
    got = run_all(batch, engine, [(PROMPTS[2], head_cfg(kind)), (PROMPTS[0], other_cfg("none"))],
                  join=(4, (long_prompt, other_cfg("lookup"))))
    assert got[0].tokens == alone_head.tokens and got[0].stats.accepted > 0
    assert (got[0].stats.drafted, got[0].stats.accepted) == (alone_head.stats.drafted, alone_head.stats.accepted)
    assert got[2].tokens == late.tokens


def test_a_request_cancelled_mid_batch_leaves_the_head_slot_unchanged(files, kind, engine, batch):
    alone_head = fresh_alone(files, kind, PROMPTS[1], head_cfg(kind))
    other = engine.complete(engine.raw_prompt(PROMPTS[0]), other_cfg("lookup"))
    got = run_all(batch, engine, [(PROMPTS[0], other_cfg("lookup")), (PROMPTS[1], head_cfg(kind)),
                                  (PROMPTS[2], other_cfg("none"))], cancel_at=(0, 6))
    assert got[0].finish_reason == "cancelled" and got[0].tokens == other.tokens[:len(got[0].tokens)]
    assert got[1].tokens == alone_head.tokens and got[1].stats.accepted > 0
    assert (got[1].stats.drafted, got[1].stats.accepted) == (alone_head.stats.drafted, alone_head.stats.accepted)


def test_a_cancelled_head_request_frees_its_slot_for_the_next_head_request(files, kind, engine, batch):
    """The slot's head follows the slot from request to request: a head request after a cancelled one and after a
    plain one in the same slots (another text at the same positions) drafts what it drafts alone."""
    first = run_all(batch, engine, [(PROMPTS[1], head_cfg(kind)), (PROMPTS[0], other_cfg("none")),
                                    (PROMPTS[2], other_cfg("none"))], cancel_at=(0, 3))
    assert first[0].finish_reason == "cancelled"
    for prompt in (PROMPTS[2], PROMPTS[0]):  # slots whose cache (and head state) came from another text
        alone_head = fresh_alone(files, kind, prompt, head_cfg(kind))
        got = run_all(batch, engine, [(prompt, head_cfg(kind)), (PROMPTS[1], head_cfg(kind)),
                                      (PROMPTS[0], other_cfg("lookup"))])
        assert got[0].tokens == alone_head.tokens
        assert (got[0].stats.drafted, got[0].stats.accepted) == (alone_head.stats.drafted, alone_head.stats.accepted)


@pytest.mark.parametrize("unified", [False, True])
def test_a_slot_reads_its_own_rows_of_a_batched_decode(heads_dir, unified):
    """The layer inputs of one sequence's rows of a MultiSeq decode (rows [1, 3, 1, 2]: over separate KV streams
    llama.cpp runs them as several passes and puts the rows back in batch order) are those of the same tokens decoded
    alone."""
    from localspec.llama.model import Model
    from localspec.llama.multiseq import MultiSeq
    from localspec.llama.taps import SeqTap, TargetTap

    path = write_model(heads_dir / "random4.gguf", 5, n_layer=4)
    lids = [0, 1, 3]
    with Model(path, n_ctx=256) as t:
        ms = MultiSeq(t, 4, unified=unified)
        try:
            taps = [SeqTap(ms, s) for s in range(4)]
            taps[0].enable_layer_inp(lids)
            prompts = [t.tokenize(p) for p in ("the cat and the dog", "def f(x): return x", "Once upon a time",
                                               "Hello world, the x = y + 1")]
            ms.decode([(s, p, []) for s, p in enumerate(prompts)])
            steps = [[9], [10, 11, 12], [13], [14, 15]]
            ms.decode([(s, toks, []) for s, toks in enumerate(steps)])
            got = [taps[s].layer_inp(lids, len(steps[s]), 64) for s in range(4)]
            tap = TargetTap(t)
            tap.enable_layer_inp(lids)
            for s in range(4):
                t.clear()
                t.decode(prompts[s] + steps[s], "last")
                want = tap.layer_inp(lids, len(prompts[s]) + len(steps[s]), 64)[-len(steps[s]):]
                assert got[s].shape == want.shape
                np.testing.assert_allclose(got[s], want, rtol=1e-3, atol=1e-3)
                assert not np.allclose(got[s][0], got[(s + 1) % 4][0], atol=1e-2)  # the rows do tell slots apart
        finally:
            ms.close()


def test_serve_parallel_decodes_a_head_request_beside_a_running_one(files, tmp_path):
    """`serve --parallel 3`: an eagle3 request sent while a long answer streams joins the batch at once (it does not
    wait for the running one to end) and answers what it answers alone."""
    import http.client
    import json

    from helpers import chat, completed, loaded_session, serving, text
    from localspec.server.config import ServerConfig

    target, head = files["eagle3"]
    settings = {"model": str(target), "draft": str(head), "method": "lookup", "draft_tokens": 4, "ctx_size": 2048,
                "p_min": 0.0, "exactness": "lossless"}
    body = chat(PROMPTS[1], localspec={"method": "eagle3", "k": 3})
    with loaded_session(settings, tmp_path / "cfg") as sess:
        with serving(sess, ServerConfig(parallel=3, queue_size=8)) as s:
            alone = completed(s, body)
            worker = s.app.state.worker
            with decodes(worker.batch) as seen:
                long = http.client.HTTPConnection(s.host, int(s.port), timeout=120)
                long.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                             body=json.dumps(chat(PROMPTS[0], max_tokens=1500, stream=True)))
                r = long.getresponse()
                assert r.status == 200
                r.readline()  # the long answer is running
                got = completed(s, body)
                assert worker.active >= 1  # the long answer still runs
                long.sock.shutdown(2)
                long.close()
            assert text(got) == text(alone)
            assert got["localspec"]["method"] == "eagle3" and got["localspec"]["accepted"] > 0
            assert sum(1 for d in seen if len(d) == 2) >= 5  # both verified in the same decodes


@pytest.fixture(scope="module")
def random_files(heads_dir) -> dict:
    """kind -> (target, head file or None): random heads, whose drafts depend on everything in their caches."""
    random4 = write_model(heads_dir / "random4-heads.gguf", 5, n_layer=4)
    return {
        "eagle3": (random4, write_eagle3(heads_dir / "eagle3-random.gguf", 11)),
        "dflash": (random4, write_dflash(heads_dir / "dflash-random.gguf", 11)),
        "mtp": (write_glm4moe_mtp(heads_dir / "glm-mtp-random.gguf", 7, mtp="random"), None),
    }


@pytest.mark.parametrize("which", ["eagle3", "dflash", "mtp"])
def test_a_head_slot_forgets_what_it_read_of_another_text(random_files, which, monkeypatch):
    """A slot's head read text X (a head request); then a plain request Y ran in the slot; a head request for Y reuses
    the slot's cache of Y, of which the head read nothing: it drafts as a head that read nothing before the rows it
    decodes (not from X's states at Y's positions), like the engine's own head after keep(0)."""
    from localspec.core.batch import BatchEngine
    from localspec.core.engine import Engine

    drafts: list = []
    target, head = random_files[which]
    x, y = PROMPTS[0], PROMPTS[2]

    def answers(run_x, run_plain_y, forget, run_y):
        run_x(x, head_cfg(which, max_tokens=12))
        run_plain_y(y, other_cfg("none"))
        forget()
        drafts.clear()
        got = run_y(y, head_cfg(which))
        return got, list(drafts)

    e = Engine.load(target, head, n_ctx=512)
    cls = type(e.heads[which])
    propose = cls.propose

    def recording(self, context, k, sp, rng):
        p = propose(self, context, k, sp, rng)
        drafts.append((len(context), list(p.tokens)))
        return p

    monkeypatch.setattr(cls, "propose", recording)
    try:
        one = lambda p, c: e.complete(e.raw_prompt(p), c)
        want, want_drafts = answers(one, one, lambda: e.heads[which].keep(0), one)
        b = BatchEngine(e, 1, prefill_chunk=16)
        try:
            batched = lambda p, c: run_all(b, e, [(p, c)])[0]
            got, got_drafts = answers(batched, batched, lambda: None, batched)
        finally:
            b.close()
    finally:
        e.close()
    assert got.tokens == want.tokens and got.stats.cached_prompt_tokens == want.stats.cached_prompt_tokens > 0
    assert len(got_drafts) > 5 and got_drafts == want_drafts


def test_chained_mtp_layers_draft_in_a_slot(heads_dir):
    """A target with two MTP layers (each draft step runs its own layer) drafts in a slot beside another request:
    both layers agree with the target, so everything drafted is accepted, as alone."""
    from localspec.core.batch import BatchEngine
    from localspec.core.engine import Engine
    from tinyheads import write_mimo2_mtp

    e = Engine.load(write_mimo2_mtp(heads_dir / "mimo2.gguf", 7, mtp=("agree", "agree")), n_ctx=512)
    try:
        cfg = lambda: head_cfg("mtp")
        alone = e.complete(e.raw_prompt(PROMPTS[0]), cfg())
        b = BatchEngine(e, 2, prefill_chunk=16)
        try:
            got = run_all(b, e, [(PROMPTS[0], cfg()), (PROMPTS[1], other_cfg("lookup"))])
        finally:
            b.close()
    finally:
        e.close()
    assert got[0].tokens == alone.tokens
    assert 0 < got[0].stats.drafted == got[0].stats.accepted
    assert got[0].stats.drafted <= 2 * got[0].stats.drafting_steps
