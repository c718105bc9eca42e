"""The prompt cache of `run` and `chat` (core/prompt_cache.py): a new process asked about the same long prompt prefix
restores the prefix's state from disk and decodes only the rest, with the tokens a cold prefill gives under bit
exactness with every drafter; only prefixes decoded as a cold prefill decodes them are kept; `--no-prompt-cache`
stores and restores nothing; `cache show` lists the states and `cache clear --prompt-states` removes only them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import cli
from localspec.store import prompt_states as PS

TEXT = "the cat and the dog and x = y + 1 " * 25
QUESTIONS = ("Hello world, the x = y + 1", "Once upon a time")
CTX = "1024"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LOCALSPEC_CONFIG_DIR", str(tmp_path / "cfg"))
    for var in ("LOCALSPEC_KV_TYPE", "LOCALSPEC_PROMPT_CACHE", "LOCALSPEC_PROMPT_CACHE_BYTES"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path / "cache"


def states(cache: Path) -> list[Path]:
    return sorted((cache / PS.FOLDER).glob("*.state"))


def run_json(target_path, draft_path, question: str, *extra: str) -> dict:
    args = ["run", "-m", str(target_path), "-d", str(draft_path), "--raw", "--json", "-n", "24", "-c", CTX,
            "--threads", "2", "--exactness", "bit", "--method", "auto", *extra, question]
    r = cli(args, stdin=TEXT.encode(), timeout=300)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    return json.loads(r.stdout)


# ------------------------------------------------------------------ across processes (the CLI)
def test_a_second_process_restores_the_prefix_and_answers_as_a_cold_prefill(target_path, draft_path, cache):
    first = run_json(target_path, draft_path, QUESTIONS[0])
    assert first["prompt_tokens"] > 600 and first["cached_prompt_tokens"] == 0 and first["prompt_cache"] == ""
    # the target's state of the piped text (to a multiple of 64 tokens); the draft model's beside it where it caught up
    kept = len(states(cache))
    assert kept in (1, 2)
    again = run_json(target_path, draft_path, QUESTIONS[1])
    piped = first["prompt_tokens"] - 12  # the question and the blank line before it take fewer than 12 tokens
    assert again["prompt_cache"] == "disk" and piped // 64 * 64 - 64 <= again["cached_prompt_tokens"] <= piped
    assert again["cached_prompt_tokens"] > 512  # not only the whole n_batch chunks: the piped text's end too
    cold = run_json(target_path, draft_path, QUESTIONS[1], "--no-prompt-cache")
    assert cold["prompt_cache"] == "" and cold["cached_prompt_tokens"] == 0
    assert again["exactness"] == cold["exactness"] == "bit"
    assert again["text"] == cold["text"] and again["completion_tokens"] == cold["completion_tokens"]
    assert len(states(cache)) == kept  # nothing new: the prefix was stored already

    show = cli(["cache", "show", "--json"])
    assert show.returncode == 0, show.stderr.decode()
    info = json.loads(show.stdout)["prompt_states"]
    assert info["count"] == kept and info["models"][target_path.name] == 1
    assert info["bytes"] == sum(f.stat().st_size for f in states(cache))
    text = cli(["cache", "show"])
    assert b"prompt states" in text.stderr and target_path.name.encode() in text.stderr

    suffix_files = sorted((cache / "suffix").glob("*.json")) if (cache / "suffix").exists() else []
    clear = cli(["cache", "clear", "--prompt-states"])
    assert clear.returncode == 0 and f"prompt states ({kept} file".encode() in clear.stderr, clear.stderr.decode()
    assert states(cache) == []
    assert json.loads(cli(["cache", "show", "--json"]).stdout)["prompt_states"]["count"] == 0
    if suffix_files:  # the suffix cache is kept
        assert all(f.exists() for f in suffix_files)


def test_no_prompt_cache_stores_nothing(target_path, draft_path, cache):
    r = run_json(target_path, draft_path, QUESTIONS[0], "--no-prompt-cache")
    assert r["prompt_cache"] == "" and r["prompt_tokens"] > 600
    assert states(cache) == []
    off = cli(["run", "-m", str(target_path), "--raw", "-n", "4", "-c", CTX, "--threads", "2", QUESTIONS[0]],
              env={"LOCALSPEC_PROMPT_CACHE": "0"}, stdin=TEXT.encode(), timeout=300)
    assert off.returncode == 0, off.stderr.decode()[-2000:]
    assert states(cache) == []


# ------------------------------------------------------------------ in one process (the engine)
@pytest.fixture
def eng(target_path, draft_path, cache):
    from localspec.core.engine import Engine
    from localspec.core.prompt_cache import PromptCache
    from localspec.store.prompt_states import PromptStates

    e = Engine.load(target_path, draft_path, n_ctx=1024, threads=2)
    e.prompt_cache = PromptCache(PromptStates())
    yield e
    e.close()


def _fresh(e) -> None:
    """As a new process finds the models: empty caches."""
    e.target.clear()
    e.draft.clear()


def _answer(e, prompt, method="auto"):
    from localspec.core.engine import GenConfig

    fin = e.complete(prompt, GenConfig(method=method, k=4, max_tokens=24, exactness="bit"))
    return fin.tokens, fin.stats


@pytest.mark.parametrize("method", ["auto", "draft", "lookup", "ngram", "suffix", "none"])
def test_restored_answers_are_cold_answers_under_bit_with_every_drafter(eng, method):
    base = eng.target.tokenize(TEXT)
    assert len(base) > 560
    a, b = (base + eng.target.tokenize(q, add_special=False) for q in QUESTIONS)
    store, pc = eng.prompt_cache.store, eng.prompt_cache
    eng.prompt_cache = None
    _fresh(eng)
    cold, st = _answer(eng, b, method)
    assert st.prompt_cache == "" and st.cached_prompt_tokens == 0
    eng.prompt_cache = pc
    _fresh(eng)
    _answer(eng, a, method)
    assert store.has(PS.state_key(eng.target), a[:512])
    if method == "draft":  # the draft model caught up with the prompt: its state is kept beside the target's
        assert store.has(PS.state_key(eng.draft), a[:512])
    _fresh(eng)
    restored, st = _answer(eng, b, method)
    assert st.prompt_cache == "disk" and st.cached_prompt_tokens == 512 and st.exactness == "bit"
    assert restored == cold
    # in this process the cache holds b and its answer: the next request reuses it from memory
    again, st = _answer(eng, b, method)
    assert st.prompt_cache == "memory" and again == cold


@pytest.mark.parametrize("method", ["auto", "draft", "lookup", "ngram", "suffix", "none"])
def test_a_prompt_split_where_its_shared_part_ends_restores_there_with_every_drafter(eng, method):
    """GenConfig.shared_upto (`run`'s piped text): the prefill splits there with or without a store, the state is
    kept there, and the next prompt with the same start and mark restores all of it and answers as a cold prefill."""
    from localspec.core.engine import GenConfig

    base = eng.target.tokenize(TEXT)
    mark = len(base) // 64 * 64
    assert mark > 576 and mark % 512
    a, b = (base + eng.target.tokenize(q, add_special=False) for q in QUESTIONS)

    def answer(prompt, upto):
        fin = eng.complete(prompt, GenConfig(method=method, k=4, max_tokens=24, exactness="bit", shared_upto=upto))
        return fin.tokens, fin.stats

    store, pc = eng.prompt_cache.store, eng.prompt_cache
    eng.prompt_cache = None
    _fresh(eng)
    cold, st = answer(b, len(base))
    assert st.cached_prompt_tokens == 0
    eng.prompt_cache = pc
    _fresh(eng)
    answer(a, len(base))
    assert store.has(PS.state_key(eng.target), a[:mark]) and not store.has(PS.state_key(eng.target), a[:512])
    _fresh(eng)
    restored, st = answer(b, len(base))
    assert st.prompt_cache == "disk" and st.cached_prompt_tokens == mark and st.exactness == "bit"
    assert restored == cold
    _fresh(eng)  # a prompt without that split never restores its state: its cold prefill has other chunks
    _, st = answer(b, 0)
    assert st.cached_prompt_tokens == 0


def test_a_prefix_pushed_out_by_another_prompt_is_kept_and_restored(eng):
    """A prefill cut short (a client that gave up) leaves whole chunks in the cache: when another prompt replaces
    them, their state is kept first, and the retry restores it and answers as a cold prefill."""
    base = eng.target.tokenize(TEXT)
    a = base + eng.target.tokenize(QUESTIONS[0], add_special=False)
    other = eng.target.tokenize("Once upon a time there was a cat. " * 8)
    store, pc = eng.prompt_cache.store, eng.prompt_cache
    eng.prompt_cache = None
    _fresh(eng)
    cold, _ = _answer(eng, a, "none")
    eng.prompt_cache = pc
    _fresh(eng)
    eng.target.decode(a[:512], [])  # one whole chunk, then the request was cancelled
    assert eng.target.cold_upto == 512 and not store.has(PS.state_key(eng.target), a[:512])
    _answer(eng, other, "none")  # another request takes the context
    assert store.has(PS.state_key(eng.target), a[:512])
    _fresh(eng)
    again, st = _answer(eng, a, "none")
    assert st.prompt_cache == "disk" and st.cached_prompt_tokens == 512 and again == cold


def test_a_prompt_after_one_that_shared_only_its_start_is_kept(eng):
    """The cache holds another request's prompt that shares a few tokens with this one (a system prompt's first
    line): the state of this prompt's prefix is still kept, those few tokens decoded again."""
    base = eng.target.tokenize(TEXT)
    a = base + eng.target.tokenize(QUESTIONS[0], add_special=False)
    _fresh(eng)
    eng.target.decode(a[:20] + eng.target.tokenize(" Once upon a time", add_special=False), [])
    _answer(eng, a, "none")
    assert eng.prompt_cache.store.has(PS.state_key(eng.target), a[:512])


def test_only_a_cold_prefix_is_kept(eng, cache):
    from localspec.core.prompt_cache import save_point

    t = eng.target
    prompt = t.tokenize(TEXT)[:700]
    assert save_point(t, len(prompt)) == 512 and save_point(t, 513) == 512 and save_point(t, 512) == 0
    t.clear()
    t.decode(prompt[:300], [])  # a prefix decoded in another chunking than a cold prefill's: never saved
    assert t.cold_upto == 0
    assert eng.prompt_cache.save_prefix(t, prompt) == 0 and states(cache) == []
    t.clear()
    t.decode(prompt[:600], [])  # one whole chunk from 0, then a partial one
    assert t.cold_upto == 512
    t.truncate(400)
    assert t.cold_upto == 400
    t.clear()
    logits = eng.prompt_cache.save_prefix(t, prompt)
    assert logits == 512 and t.cold_upto == 512 and len(t.tokens) == 512
    cold_logits = np.array(t.sync(prompt))
    # restored in a second model: the same logits for the prompt's last token as the cold prefill's
    from localspec.llama.model import Model

    with Model(eng.target.path, n_ctx=1024, n_threads=2) as m:
        assert eng.prompt_cache.restore(m, prompt) == 512 and m.cold_upto == 512
        assert np.array_equal(np.array(m.sync(prompt)), cold_logits)


def test_recurrent_models_keep_no_prompt_state(hybrid_path, cache):
    from localspec.core.engine import Engine, GenConfig
    from localspec.core.prompt_cache import PromptCache
    from localspec.store.prompt_states import PromptStates

    e = Engine.load(hybrid_path, n_ctx=1024, threads=1)
    try:
        e.prompt_cache = PromptCache(PromptStates())
        prompt = e.target.tokenize(TEXT)[:600]
        fin = e.complete(prompt, GenConfig(method="none", max_tokens=4))
        assert fin.stats.prompt_cache == "" and states(cache) == []
    finally:
        e.close()


def test_a_reopened_chat_restores_its_start_and_decodes_the_rest(eng):
    """Engine.prefill (chat --continue): the longest kept prefix restored, the rest decoded, as a cold prefill."""
    base = eng.target.tokenize(TEXT)
    history = base + eng.target.tokenize(QUESTIONS[0], add_special=False)
    _fresh(eng)
    cold = np.array(eng.target.sync(history))  # a cold prefill, no prompt cache involved
    _fresh(eng)
    assert eng.prefill(base) == len(base)  # nothing kept yet: all decoded, its first 512 tokens' state kept
    _fresh(eng)
    assert eng.prefill(history) == len(history) - 512
    assert eng.target.tokens == history and eng.draft.tokens == history
    assert np.array_equal(np.array(eng.target.sync(history)), cold)


def test_a_state_from_a_servers_memory_is_reported_as_memory(engine):
    """A request alone on a server's store (serve --parallel 1) restored from its memory says memory, not disk."""
    from localspec.core.engine import GenConfig
    from localspec.core.prompt_cache import PromptCache, ServerStates

    target, saved = engine.target, engine.prompt_cache
    engine.prompt_cache = PromptCache(ServerStates(1 << 30, None))
    try:
        prompt = (engine.raw_prompt("the cat and the dog and a x = y + 1 ") * 80)[:target.n_batch + 40]
        target.truncate(0)
        engine.complete(prompt, GenConfig(method="none", max_tokens=4))
        target.truncate(0)
        again = engine.complete(prompt, GenConfig(method="none", max_tokens=4))
        assert again.stats.cached_prompt_tokens == target.n_batch
        assert again.stats.prompt_cache == "memory"
    finally:
        engine.prompt_cache = saved
