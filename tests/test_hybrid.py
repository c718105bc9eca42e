"""Recurrent and hybrid targets (and draft models): rollback kinds, exact output of every method, the RS hazard,
the plain fallback, sampling, and the once-per-model exactness probe."""

from __future__ import annotations

import json

import numpy as np

from conftest import PROMPTS, REPEAT
from helpers import assert_same_distribution, second_tokens
from localspec.core.engine import Engine, GenConfig
from localspec.drafters.base import Drafter, Proposal
from localspec.llama.lib import ll
from localspec.llama.model import Model
from tinymodels import greedy_margins, write_lfm2

N = 60  # tokens per exactness check
CTX = 512  # below the probe's long prefix: keeps the tests fast
TOL = 0.05  # batched and one-token decoding differ by float order (<= ~0.016 here); a stale state by > 1


def _close(a, b) -> bool:
    return float(np.abs(a - b).max()) < TOL


def _plain(path, prompt, n=N):
    with Model(path, n_ctx=CTX, n_threads=1) as m:
        return greedy_margins(m, m.tokenize(prompt), n)[0]


def test_rollback_kind_is_detected(hybrid_path, mamba_path, target_path, monkeypatch):
    with Model(hybrid_path, n_ctx=CTX, n_threads=1) as m:
        assert m.is_hybrid and m.rollback_kind == "rs" and m.rs_seq >= 1
    with Model(mamba_path, n_ctx=CTX, n_threads=1) as m:  # llama.cpp clamps n_rs_seq to 0 for Mamba
        assert m.is_recurrent and m.rs_seq == 0 and m.rollback_kind == "checkpoint"
    with Model(target_path, n_ctx=CTX, n_threads=1) as m:
        assert not (m.is_recurrent or m.is_hybrid) and m.rollback_kind == "kv"
    monkeypatch.setenv("LOCALSPEC_ROLLBACK", "checkpoint")
    with Model(hybrid_path, n_ctx=CTX, n_threads=1) as m:
        assert m.rollback_kind == "checkpoint" and m.rs_seq == 0


def test_truncate_matches_one_token_decoding(recurrent):
    """Random rollbacks of every length, each followed by the next decode, give the logits of decoding the same
    tokens one at a time from scratch (up to float order: rows of a batch are not bit-identical on this build)."""
    path, kind = recurrent
    rng = np.random.default_rng(0)
    with Model(path, n_ctx=CTX, n_threads=1) as m:
        assert m.rollback_kind == kind
        ids = m.tokenize(" ".join(PROMPTS) * 2)
        ref = [m.decode([t])[0] for t in ids]
        m.clear()
        m.decode(ids[:4])
        pos = 4
        while pos < len(ids) - 10:
            b = int(rng.integers(2, 8))
            m.decode(ids[pos:pos + b], "all")
            keep = pos + int(rng.integers(0, b + 1))  # 0..b accepted: full-batch and no rollback too
            replay = m.truncate(keep)
            assert m.tokens == ids[:keep]
            assert replay == ids[m.last_replay[1]:keep] if replay else True
            row = m.decode([ids[keep]])[0]
            assert _close(row, ref[keep]), (keep, float(np.abs(row - ref[keep]).max()))
            pos = keep + 1
        c = m.rollback_counters()
        assert c["restores"] > 0 and c["checkpoint_bytes"] > 0
        assert (c["rs_rollbacks"] > 0) == (kind == "rs")


def test_rs_hazard_takes_the_checkpoint_path(hybrid_path):
    """llama.cpp's RS rollback answers true but leaves a stale state when the whole last batch is rolled back, or
    twice without a decode between: truncate restores the checkpoint there instead, and the logits stay exact."""
    with Model(hybrid_path, n_ctx=CTX, n_threads=1) as m:
        assert m.rollback_kind == "rs"
        ids = m.tokenize(PROMPTS[0] + PROMPTS[1])
        ref = [m.decode([t])[0] for t in ids]
        # the hazard is real on this build: trusting seq_rm's true reads a stale state
        m.clear()
        m.decode(ids[:5])
        m.decode(ids[5:9], "all")
        assert ll.llama_memory_seq_rm(m._mem, 0, 5, -1)
        del m.tokens[5:]
        stale = m.decode(ids[5:6])[0]
        assert float(np.abs(stale - ref[5]).max()) > 20 * TOL
        # full-batch rollback through truncate
        m.clear()
        m.decode(ids[:5])
        m.decode(ids[5:9], "all")
        before = m.rollback_counters()["restores"]
        assert m.truncate(5) == []  # restored to the checkpoint at 5: nothing to replay
        assert m.rollback_counters()["restores"] == before + 1
        assert _close(m.decode(ids[5:6])[0], ref[5])
        # two rollbacks without a decode between: the second one restores and replays
        m.decode(ids[6:10], "all")
        assert m.truncate(9) == [] and m.rollback_counters()["rs_rollbacks"] >= 1
        assert m.truncate(8) == ids[6:8]  # the checkpoint at 6 (before the 4-token batch), replay 6..7
        assert _close(m.decode(ids[8:9])[0], ref[8])
        # more than the last batch (one-token decodes, a draft model's pattern)
        for t in ids[9:12]:
            m.decode([t])
        assert m.truncate(10) and _close(m.decode(ids[10:11])[0], ref[10])


class Corrupting(Drafter):
    """Proposes the target's own greedy continuation with every third proposal corrupted at a varying position,
    so full, partial and zero acceptances all occur. Records (drafted, accepted) per step."""

    name = "lookup"

    def __init__(self, plain_tokens, prompt_len):
        self.plain, self.n0, self.steps, self.calls = plain_tokens, prompt_len, [], 0

    def propose(self, context, k, sp, rng):
        i = len(context) - self.n0  # the plain tokens context[n0:] are; what follows is plain[i:]
        toks = list(self.plain[i:i + k])
        self.calls += 1
        if toks and self.calls % 3 == 0:
            j = (self.calls // 3) % len(toks)
            toks[j] = (toks[j] + 1) % 200 + 5
        return Proposal(toks)

    def accept(self, n_drafted, n_accepted):
        self.steps.append((n_drafted, n_accepted))


def test_methods_equal_plain_decoding(recurrent, hybrid_draft_path, monkeypatch):
    """temperature 0: lookup, draft (the model itself, a low-acceptance hybrid draft) and auto give plain decoding's
    tokens, with full, partial and zero acceptances, on every rollback kind."""
    path, kind = recurrent
    prompt_text = PROMPTS[0]
    e = Engine.load(path, path, n_ctx=CTX, threads=1)
    try:
        prompt = e.raw_prompt(prompt_text)
        plain = e.complete(prompt, GenConfig(method="none", max_tokens=N)).tokens
        assert plain == _plain(path, prompt_text)
        corrupt = Corrupting(plain, len(prompt))
        monkeypatch.setattr(e, "lookup_drafter", lambda cfg: corrupt)
        r = e.complete(prompt, GenConfig(method="lookup", k=4, max_tokens=N, exactness="lossless"))
        assert r.tokens == plain
        accs = {("full" if a == d else "zero" if a == 0 else "partial") for d, a in corrupt.steps if d}
        assert accs == {"full", "partial", "zero"}
        assert r.stats.rollback == kind and r.stats.drafted > r.stats.accepted > 0
        assert r.stats.restores > 0 if kind == "checkpoint" else r.stats.rs_rollbacks > 0
        if kind == "checkpoint":
            assert r.stats.replayed_tokens > 0 and r.stats.checkpoint_bytes > 0
        monkeypatch.setattr(e, "lookup_drafter", Engine.lookup_drafter.__get__(e))
        rep = e.raw_prompt(REPEAT)
        plain_rep = e.complete(rep, GenConfig(method="none", max_tokens=N)).tokens
        r = e.complete(rep, GenConfig(method="lookup", k=4, max_tokens=N, exactness="lossless"))
        assert r.tokens == plain_rep
        assert r.stats.drafted > 0 or path.name.startswith("mamba")  # Mamba's answer does not repeat the prompt
        for k in (3, 8):  # the draft is the target itself: everything accepted, k = 8 goes past the RS planes
            r = e.complete(prompt, GenConfig(method="draft", k=k, max_tokens=N, p_min=0, exactness="lossless"))
            assert r.tokens == plain and r.stats.accepted == r.stats.drafted > 0
            assert r.stats.draft_rollback == kind
        auto = e.complete(prompt, GenConfig(max_tokens=N))  # the default: method auto, exactness auto
        assert auto.tokens == plain
    finally:
        e.close()
    if path.name.startswith("lfm2"):  # a low-acceptance hybrid draft model: its own rollbacks replay
        e = Engine.load(path, hybrid_draft_path, n_ctx=CTX, threads=1)
        try:
            r = e.complete(e.raw_prompt(prompt_text), GenConfig(method="draft", k=4, max_tokens=N, p_min=0,
                                                               exactness="lossless"))
            assert r.tokens == plain and r.stats.drafted > r.stats.accepted
            assert r.stats.draft_restores > 0  # nothing accepted: restored, nothing to replay
        finally:
            e.close()


def test_hybrid_draft_for_a_transformer_target(target_path, hybrid_path):
    """The draft model may be hybrid (Qwen3.5-0.8B for a dense target): it rolls back by checkpoint."""
    e = Engine.load(target_path, hybrid_path, n_ctx=CTX, threads=1)
    try:
        prompt = e.raw_prompt(PROMPTS[1])
        plain = e.complete(prompt, GenConfig(method="none", max_tokens=N)).tokens
        r = e.complete(prompt, GenConfig(method="draft", k=4, max_tokens=N, p_min=0, exactness="lossless"))
        assert r.tokens == plain and r.stats.drafted > 0
        assert r.stats.rollback == "kv" and r.stats.draft_rollback == "rs" and r.stats.draft_restores > 0
    finally:
        e.close()


def test_probe_and_calibration_work_on_recurrent_models(recurrent, tmp_path, monkeypatch):
    """The exactness probe and the verify-cost timing roll back through truncate (no full-batch seq_rm) and
    leave the cache as they found it."""
    from localspec.core import exactness as X
    from localspec.core.verify_cost import time_batches

    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path))
    path, kind = recurrent
    with Model(path, n_ctx=CTX, n_threads=1) as m:
        ids = m.tokenize(PROMPTS[2])
        ref = m.decode(ids)[0]
        got = X.measure(m, 5)
        assert 1 <= got["batch"] <= 5 and set(got["deviation"]) == {2, 3, 4, 5}
        assert all(v < 0.1 for v in got["deviation"].values())
        t = time_batches(m, 4, reps=1)
        assert sorted(t) == [1, 2, 3, 4]
        assert m.tokens == ids
        m.truncate(len(ids) - 1)
        assert _close(m.decode(ids[-1:])[0], ref)


def test_no_rollback_falls_back_to_plain_with_a_notice(mamba_path, monkeypatch, capsys):
    """A model on which neither RS nor checkpoints work: auto, lookup and draft decode plainly, say so once, exit 0."""
    from helpers import run_main

    monkeypatch.setenv("LOCALSPEC_ROLLBACK", "none")
    e = Engine.load(mamba_path, mamba_path, n_ctx=CTX, threads=1)
    try:
        assert e.target.rollback_kind == "none"
        prompt = e.raw_prompt(REPEAT)
        plain = e.complete(prompt, GenConfig(method="none", max_tokens=20)).tokens
        for method in ("auto", "lookup", "draft"):
            r = e.complete(prompt, GenConfig(method=method, max_tokens=20))
            assert r.tokens == plain and r.stats.method == "none" and r.stats.drafted == 0
            assert r.stats.rollback == "none" and r.stats.reason.count("cannot be rolled back") == 1
    finally:
        e.close()
    for method in ("auto", "lookup"):
        code, out, err = run_main(["run", "-m", str(mamba_path), "--raw", "-n", "12", "--threads", "1",
                                   "--method", method, "--json", REPEAT], capsys, monkeypatch)
        assert code == 0, err
        d = json.loads(out)
        assert "cannot be rolled back" in d["controller"] and d["method"] == "none" and d["drafted"] == 0


def test_sampled_speculation_on_a_hybrid_matches_plain_distribution(model_dir):
    """Temperature 1 on the hybrid (the chi-square check of tests/test_engine.py): drafted tokens the target
    rejects are rolled back through the recurrent state without changing the sampling distribution."""
    soft = write_lfm2(model_dir / "lfm2-soft.gguf", 4, out_scale=0.2)  # a spread-out next-token distribution
    soft_draft = write_lfm2(model_dir / "lfm2-soft-draft.gguf", 4, out_scale=0.25)
    e = Engine.load(soft, soft_draft, n_ctx=256, threads=1)
    try:
        prompt = e.raw_prompt("the cat")
        n = 1500
        a, _, _ = second_tokens(e, prompt, "none", 0, n, p_min=0, exactness="lossless")
        b, _, _ = second_tokens(e, prompt, "draft", 10**6, n, p_min=0, exactness="lossless")
        assert e.target.rollback_counters()["rs_rollbacks"] + e.target.rollback_counters()["restores"] > 0
        assert_same_distribution(a, b)
    finally:
        e.close()


def test_a_prefilled_prompt_is_not_replayed(recurrent):
    """sync() saves the recurrent state before a context's last token: generating from a prefilled prompt (a reopened
    chat) restores it instead of decoding the whole prompt again, and the answer is unchanged."""
    path, kind = recurrent
    e = Engine.load(path, None, n_ctx=CTX, threads=1)
    try:
        prompt = e.raw_prompt(PROMPTS[3])
        fresh = e.complete(prompt, GenConfig(method="none", max_tokens=20))
        e.target.clear()
        assert e.prefill(prompt) == len(prompt)
        r = e.complete(prompt, GenConfig(method="none", max_tokens=20))
        assert r.tokens == fresh.tokens and r.stats.cached_prompt_tokens == len(prompt) - 1
        assert r.stats.restores + r.stats.rs_rollbacks == 1 and r.stats.replayed_tokens == 0
    finally:
        e.close()
