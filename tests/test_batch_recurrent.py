"""Recurrent and hybrid models in a batch (llama/multiseq.py, core/batch.py): each sequence rolls back on its own (a
recurrent-state plane, or its own checkpoint and a replay), requests on a recurrent target (or drafting with a
recurrent draft model) decode beside each other and answer what they answer alone, and `serve --parallel N`
batches them."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from conftest import PROMPTS, RECURRENT_CTX as CTX
from helpers import alone, gen_config, recording_decodes
from localspec.core.batch import BatchEngine
from localspec.core.engine import Engine
from localspec.core.batch_probe import one_token_rows
from localspec.llama.lib import ll
from localspec.llama.model import Model
from localspec.llama.multiseq import MultiSeq, split_equal

TOL = 0.05  # batched and one-token decoding differ by float order (<= ~0.016 here); a stale state by > 1


def _close(a, b) -> bool:
    return float(np.abs(a - b).max()) < TOL


def _state(ms: MultiSeq, seq: int) -> bytes:
    """Sequence `seq`'s recurrent state, as llama.cpp saves it."""
    flags = ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
    n = int(ll.llama_state_seq_get_size_ext(ms._ctx, seq, flags))
    buf = (ctypes.c_uint8 * n)()
    got = int(ll.llama_state_seq_get_data_ext(ms._ctx, buf, n, seq, flags))
    return bytes(buf[:got])


def test_split_with_planes_keeps_each_sequences_tail_in_one_pass():
    """llama.cpp's split of a batch where the context keeps n_rs_seq planes (llama-batch.cpp, split_equal with
    n_keep_tail = n_rs_seq + 1): a sequence's last rows are never split across passes."""
    assert split_equal([(0, 1), (1, 3), (2, 1), (3, 2)], 512) == [
        [(0, 0, 1), (1, 0, 1), (2, 0, 1), (3, 0, 1)], [(1, 1, 2)], [(3, 1, 1)]]
    assert split_equal([(0, 1), (1, 3), (2, 1), (3, 2)], 512, keep_tail=9) == [
        [(0, 0, 1)], [(1, 0, 3)], [(2, 0, 1)], [(3, 0, 2)]]
    assert split_equal([(0, 4), (1, 4), (2, 4)], 512, keep_tail=9) == [[(0, 0, 4), (1, 0, 4), (2, 0, 4)]]
    # a prompt chunk longer than the tail beside one-row steps still shares their pass
    assert split_equal([(0, 30), (1, 1)], 512, keep_tail=9) == [[(0, 0, 1), (1, 0, 1)], [(0, 1, 29)]]
    # a sequence longer than a pass keeps its last keep_tail rows for the next one
    assert split_equal([(0, 20)], 16, keep_tail=9) == [[(0, 0, 11)], [(0, 11, 9)]]
    # a hybrid's unified cache: the sequences of a pass need not be consecutive
    assert split_equal([(0, 1), (2, 1)], 512, sequential=False) == [[(0, 0, 1), (2, 0, 1)]]
    assert split_equal([(0, 1), (2, 1)], 512) == [[(0, 0, 1)], [(2, 0, 1)]]


def test_each_sequence_rolls_back_on_its_own(recurrent):
    """Truncating one sequence (by a plane, or by its checkpoint and a replay) leaves the others' states as they
    were, byte for byte, and every sequence then decodes what one-token decoding of its tokens gives."""
    path, kind = recurrent
    with Model(path, n_ctx=CTX, n_threads=1) as m:
        ms = MultiSeq(m, 3)
        try:
            assert ms.rollback_kind == kind and (ms.rs_seq > 0) == (kind == "rs")
            ids = m.tokenize(" ".join(PROMPTS) * 2)
            ref = one_token_rows(ms, ids[:20])
            ms.decode([(s, ids[:5], []) for s in range(3)])
            rows = ms.decode([(s, ids[5:9], range(4)) for s in range(3)])  # one pass: 3 sequences x 4 rows
            assert all(_close(r[i], ref[5 + i]) for r in rows for i in range(4))
            others = _state(ms, 0), _state(ms, 2)
            c0 = ms.rollback_counters(1)
            ms.truncate(1, 7)  # 2 of its 4 rows rejected
            assert ms.tokens[1] == ids[:7] and ms.tokens[0] == ms.tokens[2] == ids[:9]
            c1 = ms.rollback_counters(1)
            if kind == "rs":  # its plane: nothing to replay
                assert c1["rs_rollbacks"] == c0["rs_rollbacks"] + 1 and c1["restores"] == c0["restores"]
            else:  # its checkpoint (saved before the 4 rows), then 5..6 again
                assert c1["restores"] == c0["restores"] + 1
            # a second rollback without a decode between: after a plane, its checkpoint (never a plane twice); after
            # a restore, the pending replay just gets shorter
            ms.truncate(1, 6)
            assert ms.flush() == 1  # token 5 replayed
            c2 = ms.rollback_counters(1)
            assert c2["restores"] == 1 and c2["replayed_tokens"] == c1["replayed_tokens"] + 1
            assert (_state(ms, 0), _state(ms, 2)) == others
            assert all(ms.rollback_counters(s)["restores"] == 0 for s in (0, 2))
            out = ms.decode([(0, ids[9:10], [0]), (1, ids[6:7], [0]), (2, ids[9:10], [0])])
            assert _close(out[0][0], ref[9]) and _close(out[1][0], ref[6]) and _close(out[2][0], ref[9])
            # rows of different lengths: with planes, only the last pass's sequence selects one; a sequence in an
            # earlier pass restores its checkpoint (a later pass may have moved its cell onto another's planes)
            ms.decode([(0, ids[10:14], range(4)), (1, ids[7:8], [0]), (2, ids[10:12], range(2))])
            last = {s for s, _, _ in ms.passes([(0, 4), (1, 1), (2, 2)])[-1]}
            before = [ms.rollback_counters(s) for s in range(3)]
            ms.truncate(0, 12)
            ms.truncate(2, 11)
            ms.flush()
            for s, keep in ((0, 12), (2, 11)):
                c = ms.rollback_counters(s)
                planed = c["rs_rollbacks"] - before[s]["rs_rollbacks"]
                assert planed == (kind == "rs" and s in last)
                assert c["restores"] - before[s]["restores"] == 1 - planed
            out = ms.decode([(0, ids[12:13], [0]), (1, ids[8:9], [0]), (2, ids[11:12], [0])])
            assert _close(out[0][0], ref[12]) and _close(out[1][0], ref[8]) and _close(out[2][0], ref[11])
        finally:
            ms.close()


def mutated_prompt(engine: Engine, text: str, every: int) -> list[int]:
    """`text`, the model's own greedy answer to it with every `every`-th token changed, and `text` again: prompt
    lookup drafts that answer after the second copy, and the target rejects the changed tokens (partial
    acceptances, so rollbacks)."""
    ids = engine.raw_prompt(text)
    own = alone(engine, text, gen_config("none", max_tokens=40)).tokens
    changed = [(t + 7) % engine.target.n_vocab if i % every == every - 1 else t for i, t in enumerate(own)]
    return ids + changed + ids[1:]


def test_requests_on_a_recurrent_target_batch_and_answer_as_alone(recurrent):
    """Three slots on a recurrent/hybrid target, prompt lookup with rejections: every answer is the single-sequence
    engine's, decoded in the same steps (passes, drafts, acceptances), the slots roll back on their own and each
    request's stats count its restores and replays; the steps were shared."""
    path, kind = recurrent
    e = Engine.load(path, n_ctx=CTX, threads=1)
    b = BatchEngine(e, 3, pad=False)
    try:
        assert b.ms.rollback_kind == kind and b.single_reason(gen_config("lookup")) == ""
        prompts = [mutated_prompt(e, p, every) for p, every in zip(PROMPTS, (4, 5, 7))]
        cfg = lambda: gen_config("lookup", k=4, max_tokens=50, exactness="lossless")  # noqa: E731
        single = [e.complete(list(p), cfg()) for p in prompts]
        steps0 = b.steps
        got = b.generate_all([(list(p), cfg()) for p in prompts])
        for a, r in zip(single, got):
            assert r.tokens == a.tokens and r.finish_reason == a.finish_reason
            sa, sr = a.stats, r.stats
            assert (sr.target_passes, sr.drafted, sr.accepted) == (sa.target_passes, sa.drafted, sa.accepted)
            assert sr.rollback == kind and sr.exactness == "lossless"
        st = [r.stats for r in got]
        assert sum(s.drafted for s in st) > sum(s.accepted for s in st) > 0  # rejections: rollbacks happened
        if kind == "rs":
            assert sum(s.rs_rollbacks for s in st) > 0
        else:
            assert sum(s.restores for s in st) > 0 and sum(s.replayed_tokens for s in st) > 0
            assert all(s.checkpoint_bytes > 0 for s in st if s.restores)
        assert b.steps - steps0 < sum(s.target_passes for s in st)  # they shared decodes
    finally:
        b.close()
        e.close()


def test_the_probe_decides_bit_requests_on_a_recurrent_target(hybrid_path):
    """The batch exactness probe runs on a recurrent target's slots (rolling back through its planes and
    checkpoints), and a `bit` request's level follows its verdict, saying why."""
    e = Engine.load(hybrid_path, n_ctx=CTX, threads=1)
    b = BatchEngine(e, 3)
    try:
        res = b.probe_result()
        cfg = lambda: gen_config("none", max_tokens=30, exactness="bit")  # noqa: E731
        got = b.generate_all([(e.raw_prompt(p), cfg()) for p in PROMPTS[:3]])
        for p, r in zip(PROMPTS, got):
            assert r.tokens == alone(e, p, cfg()).tokens
            if res.exact:
                assert r.stats.exactness == "bit"
            elif res.blanket:
                assert r.stats.exactness == "lossless" and res.why in r.stats.exactness_reason
            else:  # per pass shape: bit until it shared a pass the probe found not bit-identical
                assert r.stats.exactness == "bit" or "shared a pass" in r.stats.exactness_reason
    finally:
        b.close()
        e.close()


@pytest.mark.parametrize("which", ["mamba", "hybrid"])
def test_a_recurrent_draft_model_drafts_in_the_batch(which, target_path, hybrid_path, mamba_path):
    """A recurrent (Mamba: checkpoints) or hybrid (planes) draft model drafts for every slot in one batch: its
    rejected drafts are rolled out of each slot's sequence, and the answers are the single path's."""
    draft = mamba_path if which == "mamba" else hybrid_path
    e = Engine.load(target_path, draft, n_ctx=CTX, threads=1)
    b = BatchEngine(e, 3)
    try:
        assert b.drafts is not None and b.single_reason(gen_config("draft")) == ""
        cfg = lambda: gen_config("draft", k=4, max_tokens=40, p_min=0.0, exactness="lossless")  # noqa: E731
        got = b.generate_all([(e.raw_prompt(p), cfg()) for p in PROMPTS[:3]])
        assert [r.tokens for r in got] == [alone(e, p, cfg()).tokens for p in PROMPTS[:3]]
        kind = "checkpoint" if which == "mamba" else "rs"
        assert b.drafts.ms is not None and b.drafts.ms.rollback_kind == kind
        st = [r.stats for r in got]
        assert all(s.draft_rollback == kind for s in st)
        assert sum(s.drafted for s in st) > sum(s.accepted for s in st)  # a low-acceptance draft: rejections
        assert sum(s.draft_restores for s in st) > 0  # a plane selects at most within the last decode's rows
    finally:
        b.close()
        e.close()


def test_a_recurrent_target_with_a_recurrent_draft_batches(hybrid_path, hybrid_draft_path):
    e = Engine.load(hybrid_path, hybrid_draft_path, n_ctx=CTX, threads=1)
    b = BatchEngine(e, 2)
    try:
        cfg = lambda: gen_config("draft", k=3, max_tokens=30, p_min=0.0, exactness="lossless")  # noqa: E731
        got = b.generate_all([(e.raw_prompt(p), cfg()) for p in PROMPTS[:2]])
        assert [r.tokens for r in got] == [alone(e, p, cfg()).tokens for p in PROMPTS[:2]]
        assert all(r.stats.rollback == "rs" and r.stats.draft_rollback == "rs" for r in got)
    finally:
        b.close()
        e.close()


def test_serve_parallel_batches_a_recurrent_target(hybrid_path, tmp_path):
    """Through the server's queue: `--parallel 3` on a hybrid target keeps its slots (no longer one at a time), and
    three concurrent chats answer what they answer one at a time."""
    from helpers import at_once, chat, completed, loaded_session, serving, text
    from localspec.server.config import ServerConfig

    with loaded_session({"model": str(hybrid_path), "method": "lookup", "draft_tokens": 4, "ctx_size": CTX,
                         "threads": 1}, tmp_path) as sess:
        with serving(sess, ServerConfig(parallel=3, queue_size=8)) as s:
            worker = s.app.state.worker
            assert worker.batch is not None and worker.parallel == 3 and worker.kv_layout != "single"
            bodies = [chat(p, max_tokens=30) for p in PROMPTS[:3]]
            one_by_one = [text(completed(s, body)) for body in bodies]
            steps0 = worker.batch.steps
            assert [text(r) for r in at_once(s, bodies)] == one_by_one
            assert worker.batch.steps > steps0


@pytest.mark.parametrize("unified", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_random_steps_with_cells_out_of_order_never_read_a_stale_plane(hybrid_path, seed, unified):
    """Sequences that first decoded in another order than their ids (llama.cpp then gathers their recurrent cells
    for each pass, moving them), random rows per step, random rollbacks: every row equals one-token decoding. A
    sequence outside a decode's last pass never selects a plane: a later pass may have written its planes over. In
    one unified KV cache too (a hybrid's passes then take sequences that are not consecutive)."""
    with Model(hybrid_path, n_ctx=CTX, n_threads=1) as m:
        ms = MultiSeq(m, 4, unified=unified)
        try:
            rng = np.random.default_rng(seed)
            ids = m.tokenize(" ".join(PROMPTS) * 2)
            texts = {s: ids[3 * s:] for s in range(4)}
            refs = {s: one_token_rows(ms, texts[s]) for s in texts}
            pos = dict.fromkeys(texts, 4)
            for s in (3, 1, 0, 2):
                ms.decode([(s, texts[s][:4], [])])
            for _ in range(30):
                parts = []
                for s in texts:
                    if rng.random() < 0.3:
                        continue
                    b = int(rng.integers(1, 6))
                    if pos[s] + b + 2 < len(texts[s]):
                        parts.append((s, texts[s][pos[s]:pos[s] + b], range(b)))
                if not parts:
                    continue
                for (s, toks, _), rows in zip(parts, ms.decode(parts)):
                    for i in range(len(toks)):
                        assert _close(rows[i], refs[s][pos[s] + i]), (s, pos[s] + i)
                    pos[s] += int(rng.integers(0, len(toks) + 1))
                    ms.truncate(s, pos[s])
                if rng.random() < 0.5:
                    ms.flush()
            assert sum(ms.rollback_counters(s)["rs_rollbacks"] for s in texts) > 0
        finally:
            ms.close()


def test_kv_layout_auto_keeps_separate_streams_for_a_recurrent_target(hybrid_path):
    """One unified KV cache makes a transformer's step one forward pass; a recurrent state splits it into passes per
    sequence either way, so `--kv-layout auto` keeps the streams (and the exactness they keep) separate."""
    e = Engine.load(hybrid_path, n_ctx=CTX, threads=1)
    b = BatchEngine(e, 3, layout="auto")
    try:
        b.probe()
        assert b.layout == "split" and not b.ms.unified
        assert "recurrent" in b.layout_why or "bit-identical" in b.layout_why
        got = b.generate_all([(e.raw_prompt(p), gen_config("lookup", max_tokens=30)) for p in PROMPTS[:3]])
        assert [r.tokens for r in got] == [alone(e, p, gen_config("lookup", max_tokens=30)).tokens
                                           for p in PROMPTS[:3]]
    finally:
        b.close()
        e.close()


def test_a_slots_replay_is_counted_in_its_verify_cost(mamba_path, monkeypatch):
    """A rollback that leaves a replay adds the replay's rows, at the step's time per row, to what the request's
    verify cost (its stats and its controller), as the single path's clock includes its replay decode."""
    e = Engine.load(mamba_path, n_ctx=CTX, threads=1)
    b = BatchEngine(e, 2, pad=False)
    verified = BatchEngine._verified
    monkeypatch.setattr(BatchEngine, "_verified",
                        lambda self, run, rows, share, per_row: verified(self, run, rows, share, 1000.0))
    try:
        prompts = [mutated_prompt(e, p, every) for p, every in zip(PROMPTS, (4, 5))]
        got = b.generate_all([(p, gen_config("lookup", k=4, max_tokens=40, exactness="lossless")) for p in prompts])
        assert sum(r.stats.replayed_tokens for r in got) > 0
        for r in got:
            assert 1000.0 * r.stats.replayed_tokens <= r.stats.verify_s < 1000.0 * r.stats.replayed_tokens + 100
    finally:
        b.close()
        e.close()


def test_the_batch_probes_verdict_is_kept_per_rollback_kind(hybrid_path, monkeypatch):
    """Recurrent-state planes change how llama.cpp splits a batch into passes, so the cached verdict of the batch
    probe for a hybrid with planes is not the one for the same file on checkpoints."""
    keys = []
    for forced in ("", "checkpoint"):
        monkeypatch.setenv("LOCALSPEC_ROLLBACK", forced)
        e = Engine.load(hybrid_path, n_ctx=CTX, threads=1)
        b = BatchEngine(e, 2)
        try:
            keys.append((b.ms.rollback_kind, b._probe_key()))
        finally:
            b.close()
            e.close()
    assert [k for k, _ in keys] == ["rs", "checkpoint"] and keys[0][1] != keys[1][1]


@pytest.mark.parametrize("which", ["mamba", "hybrid"])
def test_a_recurrent_draft_of_another_vocabulary_drafts_in_the_batch(which, target_path, tmp_path_factory):
    """A recurrent (Mamba: checkpoints) or hybrid (planes) draft model whose vocabulary is not the target's drafts
    through text in each slot, on its own sequence of one draft context: the slots decode together, each rolls its
    rejected drafts back on its own, and the answers are the same requests' alone."""
    from tinymodels import WORDS, write_lfm2, write_mamba

    write = write_mamba if which == "mamba" else write_lfm2
    draft = write(tmp_path_factory.mktemp("xrec") / f"{which}.gguf", 2002, words=WORDS[:-2] + ["ta", "no"])
    e = Engine.load(target_path, draft, n_ctx=CTX, threads=1)
    b = BatchEngine(e, 3)
    try:
        assert e.draft_kind == "cross-vocab" and b.xvocab is not None and b.single_reason(gen_config("draft")) == ""
        cfg = lambda: gen_config("draft", k=4, max_tokens=40, p_min=0.0, exactness="lossless")  # noqa: E731
        with recording_decodes(b.ms) as seen:
            got = b.generate_all([(e.raw_prompt(p), cfg()) for p in PROMPTS[:3]])
        assert [r.tokens for r in got] == [alone(e, p, cfg()).tokens for p in PROMPTS[:3]]
        assert sum(len(s) == 3 for s in seen) >= 5  # the three slots shared steps
        kind = "checkpoint" if which == "mamba" else "rs"
        assert b.xvocab.ms is not None and b.xvocab.ms.rollback_kind == kind
        st = [r.stats for r in got]
        assert all(s.draft_rollback == kind for s in st)
        assert sum(s.drafted for s in st) > sum(s.accepted for s in st)  # rejected drafts were rolled back
        assert sum(s.draft_restores for s in st) > 0
    finally:
        b.close()
        e.close()
