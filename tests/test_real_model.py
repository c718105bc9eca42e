"""Smoke test on a real model (SmolLM2-135M-Instruct Q4_1). Skipped with a reason when the file is absent."""

from localspec.core.engine import Engine, GenConfig

N = 64


def test_smollm_lookup_and_self_draft_equal_plain(smollm_path):
    e = Engine.load(smollm_path, smollm_path, n_ctx=1024)
    try:
        prompt = e.chat_prompt([{"role": "user", "content": "Copy this line: apple, banana, cherry, date, elderberry, fig, grape."}])
        plain = e.complete(prompt, GenConfig(method="none", max_tokens=N))
        assert len(plain.tokens) > 8
        lookup = e.complete(prompt, GenConfig(method="lookup", k=4, max_tokens=N, exactness="bit"))
        assert lookup.tokens == plain.tokens
        assert lookup.stats.accepted > 0
        draft = e.complete(prompt, GenConfig(method="draft", k=4, max_tokens=N, p_min=0, exactness="bit"))
        assert draft.tokens == plain.tokens
        assert draft.stats.acceptance_rate == 1.0
        auto = e.complete(prompt, GenConfig(method="auto", k=8, max_tokens=N, exactness="bit"))
        assert auto.tokens == plain.tokens
    finally:
        e.close()


def test_smollm_long_context_stays_exact(smollm_path):
    """Past 512 KV cells llama.cpp's CPU attention splits a single query across threads; with localspec's
    BF16 KV cache the batched verify still matches one-token decoding exactly."""
    e = Engine.load(smollm_path, smollm_path, n_ctx=2048)
    try:
        text = "\n".join(f"item {i}: the value of {i} squared is {i * i}" for i in range(60))
        prompt = e.chat_prompt([{"role": "user", "content": "Continue this list exactly:\n" + text}])
        assert len(prompt) > 600
        plain = e.complete(prompt, GenConfig(method="none", max_tokens=N))
        lookup = e.complete(prompt, GenConfig(method="lookup", k=4, max_tokens=N, exactness="bit"))
        assert lookup.tokens == plain.tokens
        draft = e.complete(prompt, GenConfig(method="draft", k=4, max_tokens=N, p_min=0, exactness="bit"))
        assert draft.tokens == plain.tokens
        assert draft.stats.k_cap == 4 and draft.stats.accepted == draft.stats.drafted > 0  # batches of 5 were verified
    finally:
        e.close()


def test_qwen_warm_suffix_cache_keeps_bit(tmp_path, monkeypatch):
    """Qwen2.5-Coder-0.5B repeating emoji (byte-level tokens with near-ties: after F0 9F the bytes of two emoji are
    0.08 logits apart) with its own earlier answer in the suffix cache: at bit the repeat is drafted within the
    probe's cap, and the answer is plain decoding's. A verify wider than the cap wrote KV rows that one-token
    decoding would not, and the near-tie flipped."""
    from conftest import REAL_MODELS
    from localspec.drafters.suffix_corpus import Doc, corpus_for, private_scope, release_scope

    path = REAL_MODELS / "qwen2.5-coder-0.5b-instruct.gguf"
    if not path.is_file():
        import pytest

        pytest.skip(f"real model absent: {path} (run ../shared/models/fetch-real-models.sh)")
    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path))
    e = Engine.load(path, n_ctx=1024, threads=1)
    e.suffix_scope = scope = private_scope()
    # a verify of any width costs one step, as on a GPU: drafting the repeat always pays, whatever this CPU's timing
    e.verify_costs = lambda upto: {b: 1.0 for b in range(1, upto + 1)}
    try:
        prompt = e.chat_prompt([{"role": "user", "content": "Repeat exactly, twice: 🦄🌈🔥 👩‍👩‍👧‍👦 🇫🇷 ✅ 🦄🌈🔥"}])
        plain = e.complete(prompt, GenConfig(method="none", max_tokens=40))
        corpus_for(e.target, scope).commit(Doc("earlier", 0.0, prompt + list(plain.tokens)))
        cap = e.exact_k(4)
        for _ in range(2):
            bit = e.complete(prompt, GenConfig(method="auto", k=4, max_tokens=40, exactness="bit"))
            assert bit.stats.exactness == "bit"
            assert len(bit.stats.drafted_at) <= cap
            assert bit.text == plain.text
    finally:
        e.close()
        release_scope(scope)
