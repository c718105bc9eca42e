"""A draft model in a batch (core/batch_draft.py): every slot drafts with it, the draft decodes shared by all slots,
and the texts stay those of the single-sequence Engine."""

import functools

import pytest

from conftest import PROMPTS, check_cancel_mid_batch, require_exact_batching
from helpers import alone, at_once, chat, completed, gen_config, loaded_session, serving, text
from localspec.core.batch import BatchEngine
from localspec.core.engine import Engine
from localspec.sample.sampling import SamplingParams
from localspec.errors import UsageError

N = 100
cfg_for = functools.partial(gen_config, max_tokens=N)


@pytest.fixture(scope="module")
def twin(target_path):
    """The target drafting for itself: its drafts are accepted, so a step drafts all k tokens."""
    e = Engine.load(target_path, target_path, n_ctx=1024)
    b = BatchEngine(e, 4, prefill_chunk=16)
    yield e, b
    b.close()
    e.close()


def record_rows(monkeypatch, ms) -> list[dict[int, int]]:
    """Record, per decode of `ms`, the rows of each sequence in it."""
    rows = []
    decode = ms.decode

    def counting(parts, copy=True):
        rows.append({seq: len(t) for seq, t, _ in parts})
        return decode(parts, copy)
    monkeypatch.setattr(ms, "decode", counting)
    return rows


def test_draft_requests_are_batched_now(batch):
    assert batch.single_reason(cfg_for("draft")) == ""
    assert batch.drafts is not None


@pytest.mark.parametrize("p_min", [0.75, 0.0])
def test_four_draft_requests_at_once_equal_four_one_after_another(engine, batch, p_min, exact_batching):
    require_exact_batching(exact_batching)
    seq = [alone(engine, p, cfg_for(p_min=p_min)) for p in PROMPTS]
    got = batch.generate_all([(engine.raw_prompt(p), cfg_for(p_min=p_min)) for p in PROMPTS])
    for a, b in zip(seq, got):
        assert b.tokens == a.tokens
        assert b.text == a.text
        assert b.finish_reason == a.finish_reason
        assert b.stats.method == "draft" and b.stats.exactness == a.stats.exactness
    assert sum(r.stats.drafted for r in got) > 0  # the draft model did draft


def test_sampled_draft_requests_match_the_single_path_at_its_exactness(engine, batch, exact_batching):
    require_exact_batching(exact_batching)
    def cfgs():
        return [cfg_for(sampling=SamplingParams(temperature=0.9, seed=s), p_min=0.0) for s in (1, 2, 3, 4)]
    seq = [alone(engine, PROMPTS[i], c) for i, c in enumerate(cfgs())]
    got = batch.generate_all([(engine.raw_prompt(PROMPTS[i]), c) for i, c in enumerate(cfgs())])
    for a, b in zip(seq, got):
        assert b.stats.exactness == a.stats.exactness
        assert b.stats.drafted > 0
        # the tiny draft's rows are bit-identical in the batch (CPU), so each request's rng sees the same q rows
        assert b.tokens == a.tokens


def test_drafts_are_accepted_inside_the_batch(twin):
    engine, batch = twin
    seq = [alone(engine, p, cfg_for(p_min=0.0)) for p in PROMPTS]
    got = batch.generate_all([(engine.raw_prompt(p), cfg_for(p_min=0.0)) for p in PROMPTS])
    for a, b in zip(seq, got):
        assert b.tokens == a.tokens
        st = b.stats
        assert st.drafted > 0 and st.accepted > 0 and st.method_used["draft"] > 0
        assert st.target_passes < st.completion_tokens  # passes that emitted more than one token
        assert st.draft_rollback == "kv"


def test_the_draft_model_decodes_once_per_round_for_all_slots(twin):
    """One catch-up decode plus k - 1 decodes for the rest of the k drafts (the first comes from the catch-up row),
    for ALL drafting slots together, not per slot."""
    engine, batch = twin
    k = 4
    for p in PROMPTS:
        batch.add(engine.raw_prompt(p), cfg_for(k=k, p_min=0.0, max_tokens=60))
    while any(r.prefill for r in batch.runs if r is not None):  # the prompts, 16 tokens a step
        batch.step()
    ms = batch.drafts._multiseq()
    checked = 0
    for _ in range(6):
        runs = [r for r in batch.runs if r is not None and r.finish is None]
        if len(runs) < 4 or any(r.cfg.max_tokens - r.stats.completion_tokens <= k for r in runs):
            break
        d0 = ms.decodes
        drafted0 = [r.stats.drafted for r in runs]
        batch.step()
        drafted = [r.stats.drafted - d for r, d in zip(runs, drafted0)]
        assert batch.drafts.catch_up_decodes == 1
        if all(n == k for n in drafted):  # no slot stopped early (an end-of-generation draft)
            assert batch.drafts.draft_decodes == k - 1
            assert ms.decodes - d0 == k  # per slot it would be 4 * k
            checked += 1
    assert checked >= 2
    while batch.active:
        batch.step()


def test_a_request_cancelled_mid_batch_leaves_the_others_unchanged(engine, batch):
    check_cancel_mid_batch(engine, batch, lambda: [(p, cfg_for()) for p in PROMPTS], 10)


def test_a_continued_chat_catches_the_draft_up_from_its_slot(twin, monkeypatch):
    """The slot's draft sequence keeps the conversation: the next turn's catch-up decodes only what is new."""
    engine, batch = twin
    prompt = engine.raw_prompt(PROMPTS[2])
    first = batch.generate_all([(prompt, cfg_for(p_min=0.0, max_tokens=20))])[0]
    again = prompt + first.tokens + engine.raw_prompt(" and then")
    rows = record_rows(monkeypatch, batch.drafts._multiseq())
    got = batch.generate_all([(again, cfg_for(p_min=0.0, max_tokens=20))])[0]
    assert got.stats.cached_prompt_tokens >= len(prompt) + len(first.tokens) - 2
    assert sum(rows[0].values()) <= len(again) - len(prompt) - len(first.tokens) + 3  # the draft's first catch-up: the new part
    assert got.tokens == alone(engine, again, cfg_for(p_min=0.0, max_tokens=20)).tokens
    assert got.stats.accepted > 0


def test_a_slot_reused_by_another_prompt_catches_up_from_scratch(engine, batch):
    batch.generate_all([(engine.raw_prompt(PROMPTS[0]), cfg_for(max_tokens=10))])
    got = batch.generate_all([(engine.raw_prompt(PROMPTS[3]), cfg_for())])[0]
    assert got.tokens == alone(engine, PROMPTS[3], cfg_for()).tokens


def test_auto_may_choose_the_draft_model_in_a_batch(twin):
    engine, batch = twin
    got = batch.generate_all([(engine.raw_prompt(p), cfg_for("auto", p_min=0.0)) for p in PROMPTS])
    assert all(r.stats.method == "auto" for r in got)
    assert [r.tokens for r in got] == [alone(engine, p, cfg_for("auto", p_min=0.0)).tokens for p in PROMPTS]
    assert "batched: auto speculates with prompt lookup" not in got[0].stats.reason


def test_a_recurrent_draft_model_that_cannot_roll_back_keeps_the_single_path(target_path, tmp_path, monkeypatch):
    """A recurrent draft model drafts in the batch (tests/test_batch_recurrent.py) where its state rolls back; where
    it cannot (rollback none), draft-model requests take the single-sequence path."""
    from tinymodels import write_mamba

    monkeypatch.setenv("LOCALSPEC_ROLLBACK", "none")
    e = Engine.load(target_path, write_mamba(tmp_path / "mamba.gguf", 3), n_ctx=512)
    b = BatchEngine(e, 2)
    try:
        assert b.drafts is None
        why = b.single_reason(cfg_for("draft"))
        assert "recurrent" in why and "single-sequence" in why
        assert b.single_reason(cfg_for("auto")) == ""  # auto batches with prompt lookup alone
        with pytest.raises(UsageError):
            b.add(e.raw_prompt(PROMPTS[0]), cfg_for("draft"))
    finally:
        b.close()
        e.close()


def test_a_request_the_batch_cannot_take_runs_alone_on_the_targets_own_context(target_path, tmp_path, monkeypatch):
    """The server's one loop: where single_reason gives a reason (a draft model that cannot roll back), the request
    waits for the batch, then is stepped alone on the target's own context (the same scheduler, one slot) and answers
    what the Engine answers; the next request shares the batch again."""
    import asyncio
    from types import SimpleNamespace

    from tinymodels import write_mamba
    from localspec.core.engine import Finished
    from localspec.server.queue import Job, Worker

    monkeypatch.setenv("LOCALSPEC_ROLLBACK", "none")
    e = Engine.load(target_path, write_mamba(tmp_path / "mamba.gguf", 3), n_ctx=512)
    worker = Worker(SimpleNamespace(engine=e, gen_config=lambda: cfg_for("lookup")), 8, log=lambda m: None,
                    parallel=2)
    stepped: list = []
    step = BatchEngine.step
    monkeypatch.setattr(BatchEngine, "step", lambda self: stepped.append(self.n_slots) or step(self))

    async def ask(cfg) -> Finished:
        job = Job(lambda eng: eng.raw_prompt(PROMPTS[0]), cfg, asyncio.get_running_loop(), asyncio.Queue())
        worker.submit(job)
        while True:
            ev = await job.events.get()
            if isinstance(ev, Exception):
                raise ev
            if isinstance(ev, Finished):
                return ev

    try:
        draft = cfg_for("draft", max_tokens=30)
        assert "cannot be rolled back" in worker.batch.single_reason(draft) and worker.alone.single_reason(draft) == ""
        fin = asyncio.run(ask(draft))
        assert set(stepped) == {1} and worker.batch.steps == 0  # alone, on the target's own context
        assert fin.tokens == alone(e, PROMPTS[0], draft).tokens and "rollback: none" in fin.stats.reason
        stepped.clear()
        fin = asyncio.run(ask(cfg_for("lookup", max_tokens=30)))
        assert set(stepped) == {2} and fin.tokens == alone(e, PROMPTS[0], cfg_for("lookup", max_tokens=30)).tokens
    finally:
        assert worker.stop()
        e.close()


def test_serve_parallel_batches_draft_requests(target_path, draft_path, tmp_path):
    """Through the server's queue: four concurrent `method draft` chats run in the batch, drafting there, and answer
    what they answer one at a time."""
    from localspec.server.config import ServerConfig

    with loaded_session({"model": str(target_path), "draft": str(draft_path), "method": "draft", "draft_tokens": 4,
                         "ctx_size": 1024}, tmp_path) as sess:
        with serving(sess, ServerConfig(parallel=4, queue_size=8)) as s:
            bodies = [chat(p, max_tokens=30) for p in PROMPTS]
            alone_ = [text(completed(s, b)) for b in bodies]
            steps0 = s.app.state.worker.batch.steps
            got = [text(r) for r in at_once(s, bodies)]
            assert got == alone_
            batch = s.app.state.worker.batch
            assert batch.steps > steps0 and batch.drafts.ms is not None  # decoded in the batch, drafted there


def test_rejected_drafts_are_rolled_out_of_each_slots_draft_sequence(engine, batch):
    """After every step each slot's draft sequence is a prefix of its context: the rejected drafts are gone."""
    for p in PROMPTS:
        batch.add(engine.raw_prompt(p), cfg_for(p_min=0.0, max_tokens=40))
    rejected = 0
    while batch.active:
        runs = [r for r in batch.runs if r is not None]
        before = [(r.stats.drafted, r.stats.accepted) for r in runs]
        batch.step()
        ms = batch.drafts.ms
        for r, (d0, a0) in zip(runs, before):
            if r.stats.drafted == d0:
                continue  # not drafted this step (prefilling): its sequence may hold an earlier request's tokens
            rejected += (r.stats.drafted - d0) - (r.stats.accepted - a0)
            held = ms.tokens[r.seq]
            assert held == r.context[:len(held)]
    assert rejected > 0  # the low-acceptance draft: there were rejections to roll back


def test_a_draft_that_ends_the_answer_stops_drafting_for_its_slot(twin):
    """An end-of-generation draft ends that slot's drafting (nothing after it could be emitted); the other slot
    drafts on, in the same decodes."""
    import dataclasses

    from localspec.core.batch_draft import BatchDraft
    from localspec.sample.sampling import bias_vector

    engine, _ = twin
    eog = next(t for t in range(engine.target.n_vocab) if engine.target.is_eog(t))
    bd = BatchDraft(engine, 2)
    try:
        for d in bd.slots:
            d.p_min = 0.0
        plain = SamplingParams()
        to_eog = dataclasses.replace(plain, bias=bias_vector({eog: 1000.0}, engine.target.n_vocab))
        ctx = [engine.raw_prompt(PROMPTS[0]), engine.raw_prompt(PROMPTS[1])]
        bd.draft_for([(bd.slots[0], ctx[0], 4, to_eog, None), (bd.slots[1], ctx[1], 4, plain, None)])
        assert bd.slots[0].ready.tokens == [eog]
        assert len(bd.slots[1].ready.tokens) == 4
        assert (bd.catch_up_decodes, bd.draft_decodes) == (1, 3)
        assert bd.ms.tokens[0] == ctx[0]  # the end-of-generation draft was not decoded
    finally:
        bd.close()


def test_a_new_draft_request_takes_a_shared_prefix_from_another_slots_draft_cache(twin, monkeypatch):
    """A request joining while another runs (another slot) shares its start (a system prompt): the draft model's
    first catch-up for it decodes only what differs, the prefix copied from the running slot's draft sequence."""
    engine, batch = twin
    head = " ".join(PROMPTS * 2)
    first, second = engine.raw_prompt(head + " and then"), engine.raw_prompt(head + " or else")
    shared = len(engine.raw_prompt(head))
    cfg = lambda: cfg_for(p_min=0.0, max_tokens=20)
    results = {}
    batch.add(first, cfg(), sink=lambda ev: results.__setitem__(0, ev))
    while batch.runs[0] is None or batch.runs[0].prefill or len(batch.drafts.tokens(0)) < len(first) - 1:
        batch.step()
    rows = record_rows(monkeypatch, batch.drafts._multiseq())
    seq = batch.add(second, cfg(), sink=lambda ev: results.__setitem__(1, ev))
    assert seq != 0
    while batch.active:
        batch.step()
    caught = next(r[seq] for r in rows if seq in r)  # its first catch-up
    assert caught <= len(second) - shared + 1
    assert results[1].tokens == alone(engine, second, cfg()).tokens
    assert results[0].tokens == alone(engine, first, cfg()).tokens


def test_a_long_prompt_catches_the_draft_up_in_chunks_beside_the_running_requests(twin, monkeypatch):
    """A new prompt's prefill is chunked so it does not stall the others, the draft model's catch-up too (not one
    decode of hundreds of rows in the request's first draft step, the running requests waiting). The target
    prefills 16 tokens a step here; the draft catches up 16 a step, drafting nothing until it is caught up, while
    the others keep generating; the texts are those of the single path."""
    engine, batch = twin
    long_prompt = engine.raw_prompt(" ".join(PROMPTS * 5))
    assert len(long_prompt) > 8 * batch.prefill_chunk
    cfg = lambda n: cfg_for(p_min=0.0, max_tokens=n)  # noqa: E731
    results = {}
    batch.add(engine.raw_prompt(PROMPTS[0]), cfg(60), sink=lambda ev: results.__setitem__(0, ev))
    for _ in range(3):
        batch.step()
    rows = record_rows(monkeypatch, batch.drafts._multiseq())
    batch.add(long_prompt, cfg(60), sink=lambda ev: results.__setitem__(1, ev))
    while batch.active:
        batch.step()
    assert max(max(r.values()) for r in rows) <= batch.prefill_chunk
    assert results[0].tokens == alone(engine, PROMPTS[0], cfg(60)).tokens
    assert results[1].tokens == alone(engine, long_prompt, cfg(60)).tokens
    assert results[1].stats.drafted > 0  # it did draft once caught up
