"""A draft model with another vocabulary drafts through text: exact at temperature 0, the target's distribution above
it, unmappable tokens end a proposal, never the answer."""

from __future__ import annotations

import pytest

from conftest import N_EXACT, PROMPTS
from helpers import assert_same_distribution, recording_decodes, second_tokens
from tinymodels import WORDS, write_model
from localspec.core.engine import Engine, GenConfig
from localspec.models.gguf_header import read_file_metadata

# the target's words with the last two changed: the same weights (write_model draws them by shape), another vocabulary
NEAR_WORDS = WORDS[:-2] + ["ta", "no"]


@pytest.fixture(scope="module")
def near_path(target_path, tmp_path_factory):
    """A draft with the target's weights and a vocabulary that differs in two tokens: it agrees with the target
    nearly everywhere, so proposals are long and mostly accepted."""
    seed = int(str(read_file_metadata(target_path, tokens=False)["general.name"]).split("-")[1])
    return write_model(tmp_path_factory.mktemp("near") / "near.gguf", seed, words=NEAR_WORDS)


@pytest.fixture(scope="module")
def plain(target_path):
    e = Engine.load(target_path, None, n_ctx=1024)
    try:
        yield {p: e.complete(e.raw_prompt(p), GenConfig(method="none", max_tokens=N_EXACT)).tokens for p in PROMPTS}
    finally:
        e.close()


@pytest.fixture(scope="module")
def other_engine(target_path, other_vocab_path):
    e = Engine.load(target_path, other_vocab_path, n_ctx=1024)
    yield e
    e.close()


@pytest.fixture(scope="module")
def near_engine(target_path, near_path):
    e = Engine.load(target_path, near_path, n_ctx=1024)
    yield e
    e.close()


def test_pair_is_cross_vocab(other_engine, near_engine):
    from localspec.drafters.cross_vocab import CrossVocabDrafter

    for e in (other_engine, near_engine):
        assert e.draft_kind == "cross-vocab"
        assert isinstance(e.draft_drafter(GenConfig()), CrossVocabDrafter)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_other_vocab_draft_equals_plain(other_engine, plain, k):
    """A draft that shares nothing with the target (other words, merges): many rejections, the same tokens."""
    drafted = 0
    for p in PROMPTS:
        r = other_engine.complete(other_engine.raw_prompt(p), GenConfig(method="draft", k=k, max_tokens=N_EXACT,
                                                                         p_min=0.0))
        assert r.tokens == plain[p], (p, k)
        drafted += r.stats.drafted
        assert r.stats.accepted < r.stats.drafted
    assert drafted > 0


@pytest.mark.parametrize("k", [2, 6])
def test_near_vocab_draft_equals_plain_and_is_accepted(near_engine, plain, k):
    for p in PROMPTS:
        r = near_engine.complete(near_engine.raw_prompt(p), GenConfig(method="draft", k=k, max_tokens=N_EXACT,
                                                                       p_min=0.0))
        assert r.tokens == plain[p], (p, k)
        assert r.stats.drafted > 0
        # the same weights: most of what it drafts through text is the target's own choice
        assert r.stats.accepted > 0.5 * r.stats.drafted, (p, r.stats.accepted, r.stats.drafted)
        assert r.stats.method_used["draft"] > 0


def test_draft_context_follows_text_without_drift(near_engine, plain):
    """After a long answer the draft's cache holds exactly its own tokenization of the target's text."""
    p = PROMPTS[0]
    prompt = near_engine.raw_prompt(p)
    near_engine.complete(prompt, GenConfig(method="draft", k=4, max_tokens=N_EXACT, p_min=0.0))
    d = near_engine.draft_drafter(GenConfig())
    context = prompt + plain[p][:-1]
    assert d.lag(context) <= 8  # it followed the answer step by step
    text = b"".join(near_engine.target.piece(t) for t in context[1:])  # the target's BOS left out
    want = [near_engine.draft.vocab_info().bos] + d.dv.tokenize(text, parse_special=True)
    assert d.draft_context(context) == want
    d.catch_up(context)
    assert near_engine.draft.tokens == want
    # the cache it built over the answer was already that tokenization, but for the last few tokens
    assert near_engine.draft.reused >= len(want) - 12, (near_engine.draft.reused, len(want))


def test_auto_costs_the_cross_vocab_draft(near_engine, plain):
    r = near_engine.complete(near_engine.raw_prompt(PROMPTS[1]), GenConfig(method="auto", k=4, max_tokens=N_EXACT))
    assert r.tokens == plain[PROMPTS[1]]
    assert "draft" in near_engine.drafters_for(GenConfig(), "auto")


def test_sampled_cross_vocab_keeps_the_target_distribution(target_path, near_path):
    """Temperature 1: the token at a drafted position has the same distribution with the cross-vocabulary draft
    (deterministic proposals, Leviathan's rule with a one-hot q) as with plain sampling (chi-square, 1500 runs each)."""
    e = Engine.load(target_path, near_path, n_ctx=256)
    try:
        prompt = e.raw_prompt("def f(x): return x")
        n = 1500
        a, _, _ = second_tokens(e, prompt, "none", 0, n, p_min=0)
        b, drafted, _ = second_tokens(e, prompt, "draft", 10**6, n, p_min=0)
        assert drafted > n // 2  # the position was drafted in most runs
        assert_same_distribution(a, b)
    finally:
        e.close()


def test_unmappable_draft_token_ends_the_proposal_not_the_answer(near_engine, plain, monkeypatch):
    """A draft control token (which has no text to map) in the middle of the draft's run: the proposal stops before
    it and the answer goes on, identical to plain."""
    d = near_engine.draft_drafter(GenConfig())
    p, cfg = PROMPTS[2], GenConfig(method="draft", k=6, max_tokens=N_EXACT, p_min=0.0)
    free = near_engine.complete(near_engine.raw_prompt(p), cfg)
    assert len(free.stats.drafted_at) >= 4  # without the control token, proposals grow long
    im_end = near_engine.draft.tokenize("<|im_end|>", add_special=False, parse_special=True)
    assert len(im_end) == 1 and d.dv.is_control(im_end[0])
    real = near_engine.draft.decode
    calls = {"n": 0}

    def decode(tokens, rows="last", copy=True, **kw):
        out = real(tokens, rows, copy=True, **kw)
        calls["n"] += 1
        if calls["n"] % 2 == 0:  # every second draft row prefers the control token
            out[-1][im_end[0]] = out[-1].max() + 10.0
        return out

    monkeypatch.setattr(near_engine.draft, "decode", decode)
    r = near_engine.complete(near_engine.raw_prompt(p), cfg)
    assert r.tokens == plain[p]
    assert r.stats.drafted > 0 and r.finish_reason == "length"
    # a proposal never runs past a control token: one draft row at most before one, so short proposals only
    assert len(r.stats.drafted_at) <= 2, r.stats.drafted_at


def test_to_target_stops_where_the_target_cannot_represent_the_bytes(near_engine):
    from localspec.drafters.cross_vocab import to_target

    tv = near_engine.draft_drafter(GenConfig()).tv
    ok = to_target(tv, b" the", b" x = y")
    assert ok and b"".join(near_engine.target.piece(t) for t in ok) == b" x = y"
    # a byte the target renders otherwise (its unknown token stands for it): the list ends before it
    real = tv.model.piece
    unk = {0}
    tv.model.piece = lambda t: b"\xe2\x96\x85" if t in unk else real(t)  # noqa: E731
    try:
        ids = tv.tokenize(b" the x", parse_special=False)
        unk.clear()
        unk.add(ids[-1])
        assert to_target(tv, b" the", b" x") == []
    finally:
        del tv.model.piece


def test_bytes_a_bpe_target_cannot_take_end_proposals_not_the_answer(smollm_path, other_vocab_path, monkeypatch):
    """SmolLM2 (a byte-level BPE vocabulary) as the target, the tiny random SentencePiece model as its draft: the
    draft writes lone byte tokens, invalid UTF-8 that the target's tokenizer cannot reproduce; those proposals end
    there, and the answer is plain decoding's, to its full length."""
    e = Engine.load(smollm_path, other_vocab_path, n_ctx=512, threads=2)
    try:
        assert e.draft_kind == "cross-vocab"
        prompt = e.chat_prompt([{"role": "user", "content": "Name three colours."}])
        from localspec.drafters import cross_vocab

        cut = []
        real = cross_vocab.to_target

        def to_target(tv, anchor, new):
            out = real(tv, anchor, new)
            if out is not None and len(b"".join(tv.model.piece(t) for t in out)) < len(new):
                cut.append(new)  # bytes the target's tokens could not reproduce
            return out

        monkeypatch.setattr(cross_vocab, "to_target", to_target)
        plain = e.complete(prompt, GenConfig(method="none", max_tokens=48))
        r = e.complete(prompt, GenConfig(method="draft", k=4, max_tokens=48, p_min=0.0))
        assert r.tokens == plain.tokens and r.text == plain.text
        assert cut and r.stats.drafted > 0 and r.finish_reason == plain.finish_reason
        assert r.stats.method_used["draft"] + r.stats.method_used["none"] == r.stats.target_passes
    finally:
        e.close()


def test_bpe_draft_context_is_its_tokenization_of_the_text_at_every_step(smollm_path, target_path):
    """SmolLM2 (byte-level BPE) drafting for the tiny target: as the target's context grows token by token (and is
    cut back, as a new prompt would), the draft's context, kept by tokenizing only the text after a safe boundary, is
    at every step exactly SmolLM2's tokenization of the whole text."""
    from localspec.drafters.cross_vocab import CrossVocabDrafter
    from localspec.llama.model import Model

    text = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
            "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
            "The loop runs n times; naïve recursion would take exponential time — ça va? 日本語 too.\n") * 3
    with Model(target_path, n_ctx=2048) as tgt, Model(smollm_path, n_ctx=2048, n_threads=2) as smol:
        d = CrossVocabDrafter(smol, tgt, p_min=0.0)
        ctx = tgt.tokenize(text)
        bos = [smol.vocab_info().bos] if smol.vocab_info().add_bos else []
        real, sizes = d.dv.tokenize, []

        def tokenize(data, parse_special):
            sizes.append(len(data))
            return real(data, parse_special)

        for n in [*range(2, len(ctx), 3), len(ctx), len(ctx) // 2, len(ctx)]:
            d.dv.tokenize = tokenize
            got = d.draft_context(ctx[:n])
            d.dv.tokenize = real
            whole = b"".join(tgt.piece(t) for t in ctx[1:n])
            assert got == bos + real(whole, parse_special=True), n
        # a step tokenizes about the new text, not the whole of it (about 1 KB at the end)
        assert len(sizes) > 100 and sorted(sizes)[len(sizes) // 2] < 100, sizes


def test_cross_vocab_drafts_run_in_batch_slots_beside_other_requests(near_engine, plain, monkeypatch):
    """Draft-model requests whose draft has another vocabulary are decoded in batch slots, each drafting through
    text on its own sequence of one shared context of the draft model, beside a plain and a lookup request: every
    answer is plain decoding's, the four are decoded in the same steps, and the drafts are accepted inside the
    batch."""
    from localspec.core.batch import BatchEngine

    b = BatchEngine(near_engine, 4, prefill_chunk=16)
    try:
        assert b.single_reason(GenConfig(method="draft")) == ""
        assert b.drafts is None and b.xvocab is not None and b.xvocab.ms is None  # made at the first draft
        methods = ["draft", "none", "draft", "lookup"]
        reqs = [(near_engine.raw_prompt(p), GenConfig(method=m, k=4, max_tokens=N_EXACT, p_min=0.0))
                for p, m in zip(PROMPTS, methods)]
        with recording_decodes(b.ms) as seen:
            got = b.generate_all(reqs)
        for p, fin in zip(PROMPTS, got):
            assert fin.tokens == plain[p], p
        assert sum(len(s) == 4 for s in seen) >= N_EXACT // 4  # the four requests shared most steps
        for fin in (got[0], got[2]):
            st = fin.stats
            assert st.drafted > 0 and st.accepted > 0.5 * st.drafted and st.method_used["draft"] > 0
        assert b.xvocab.ms is not None and b.xvocab.ms.tokens[0] and b.xvocab.ms.tokens[2]
        assert not b.xvocab.ms.tokens[1] and not b.xvocab.ms.tokens[3]  # a slot that never drafted holds no draft KV
    finally:
        b.close()


def test_prefill_puts_the_drafts_own_tokens_in_its_cache(near_engine, plain):
    """A prefilled prompt (a reopened chat) reaches the draft model as its own tokenization of the prompt's text,
    never as the target's token ids."""
    prompt = near_engine.raw_prompt(PROMPTS[3])
    near_engine.draft.clear()
    near_engine.prefill(prompt)
    d = near_engine.draft_drafter(GenConfig())
    assert near_engine.draft.tokens == d.draft_context(prompt) != prompt
    r = near_engine.complete(prompt, GenConfig(method="draft", k=4, max_tokens=N_EXACT, p_min=0.0))
    assert r.tokens == plain[PROMPTS[3]]


def test_serve_parallel_batches_cross_vocab_draft_requests(target_path, near_path, tmp_path):
    """Through the server's queue: four concurrent `method draft` chats with a draft of another vocabulary run in the
    batch (they do not wait for it to drain), drafting there, and answer what they answer one at a time."""
    from helpers import at_once, chat, completed, loaded_session, serving, text
    from localspec.server.config import ServerConfig

    with loaded_session({"model": str(target_path), "draft": str(near_path), "method": "draft", "draft_tokens": 4,
                         "ctx_size": 1024}, tmp_path) as sess:
        with serving(sess, ServerConfig(parallel=4, queue_size=8)) as s:
            bodies = [chat(p, max_tokens=30) for p in PROMPTS]
            alone_ = [text(completed(s, b)) for b in bodies]
            batch = s.app.state.worker.batch
            steps0, decodes0 = batch.steps, batch.xvocab.ms.decodes if batch.xvocab.ms is not None else 0
            got = [text(r) for r in at_once(s, bodies)]
            assert got == alone_
            assert batch.steps > steps0 and batch.xvocab.ms.decodes > decodes0  # decoded and drafted in the batch
