"""Shared fixtures: tiny fabricated GGUF models (target, low-acceptance draft, other-vocab model), isolated
configuration, and a loaded session with a server on it for the server tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tinymodels import OTHER_WORDS, greedy_margins, write_model, write_no_vocab

PROMPTS = ["Hello world, the x = y + 1", "def f(x): return x", "the cat and the dog", "Once upon a time"]
N_EXACT = 200
MIN_MARGIN = 0.05  # plain greedy's top-2 logit margin over the test length; batch-shape noise is < 0.006
REAL_MODELS = Path(os.environ.get("LOCALSPEC_TEST_MODELS", Path.home() / ".cache" / "localspec-test-models"))


def pytest_configure(config):
    # keep the tests' caches (exact-batch probes, downloads) out of the user's cache dir ...
    import tempfile

    os.environ.setdefault("LOCALSPEC_CACHE_DIR", tempfile.mkdtemp(prefix="localspec-test-cache-"))
    # and the chat history out of the user's data dir
    os.environ.setdefault("LOCALSPEC_DATA_DIR", tempfile.mkdtemp(prefix="localspec-test-data-"))
    # a suite started in the background by a script (`pytest &` without job control) inherits SIGINT ignored, and so
    # would every process it starts: the Ctrl-C tests need SIGINT's usual disposition, here and in their children
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


def wide_margin_model(path_for, write, seeds, prompts, n: int, min_margin: float, **model_kw) -> Path:
    """`write(path_for(seed), seed)` for the first of `seeds` whose plain greedy decoding keeps a top-2 logit margin
    of `min_margin` or more over `n` tokens of every prompt (`model_kw`: the Model's, to measure it)."""
    from localspec.llama.model import Model

    for seed in seeds:
        path = write(path_for(seed), seed)
        with Model(path, **model_kw) as m:
            margins = [greedy_margins(m, m.tokenize(p), n)[1] for p in prompts]
        if min(margins) >= min_margin:
            return path
    raise RuntimeError(f"no seed in {seeds} gives margins >= {min_margin}")


@pytest.fixture(scope="session")
def target_path(model_dir) -> Path:
    return wide_margin_model(lambda seed: model_dir / "target.gguf", write_model, range(1, 40), PROMPTS, N_EXACT + 40,
                             MIN_MARGIN, n_ctx=1024)


@pytest.fixture(scope="session")
def draft_path(model_dir, target_path) -> Path:
    # same vocab, other weights: a low-acceptance draft
    return write_model(model_dir / "draft.gguf", 1001)


@pytest.fixture(scope="module")
def engine(target_path, draft_path):
    """An Engine on the tiny target with the tiny (low-acceptance) draft model, per test module."""
    from localspec.core.engine import Engine

    e = Engine.load(target_path, draft_path, n_ctx=1024)
    yield e
    e.close()


@pytest.fixture(scope="module")
def batch(engine):
    """A 4-slot BatchEngine over `engine` (prompts prefilled 16 tokens a step), per test module."""
    from localspec.core.batch import BatchEngine

    b = BatchEngine(engine, 4, prefill_chunk=16)
    yield b
    b.close()


REPEAT = "the cat and the dog and the cat and the dog and the cat and the"  # prompt lookup finds matches
RECURRENT_CTX = 512  # the recurrent models' context in their tests (below the exactness probe's long prefix)


def _recurrent_model(path_for, writer) -> Path:
    """A fabricated recurrent/hybrid model whose greedy margins stay >= 0.1 over 70 tokens of every prompt (its
    verify rows differ from one-token decodes by up to ~0.016)."""
    return wide_margin_model(path_for, writer, range(1, 30), PROMPTS + [REPEAT], 70, 0.1, n_ctx=RECURRENT_CTX,
                             n_threads=1)


@pytest.fixture(scope="session")
def hybrid_path(model_dir) -> Path:
    """An LFM2-style hybrid (short-convolution recurrent layers and attention): rolls back by RS planes."""
    from tinymodels import write_lfm2

    return _recurrent_model(lambda s: model_dir / f"lfm2-{s}.gguf", write_lfm2)


@pytest.fixture(scope="session")
def hybrid_draft_path(model_dir) -> Path:  # same vocab, other weights: low acceptance
    from tinymodels import write_lfm2

    return write_lfm2(model_dir / "lfm2-draft.gguf", 2001)


@pytest.fixture(scope="session")
def mamba_path(model_dir) -> Path:
    """A Mamba-1 model (purely recurrent): rolls back by checkpoints."""
    from tinymodels import write_mamba

    return _recurrent_model(lambda s: model_dir / f"mamba-{s}.gguf", write_mamba)


@pytest.fixture(params=["rs", "checkpoint", "mamba"])
def recurrent(request, hybrid_path, mamba_path, monkeypatch):
    """(path, expected rollback kind): the hybrid with RS planes, the hybrid forced onto checkpoints, Mamba-1."""
    if request.param == "checkpoint":
        monkeypatch.setenv("LOCALSPEC_ROLLBACK", "checkpoint")
    path = mamba_path if request.param == "mamba" else hybrid_path
    return path, "checkpoint" if request.param == "mamba" else request.param


@pytest.fixture(scope="session")
def other_vocab_path(model_dir) -> Path:
    return write_model(model_dir / "other.gguf", 7, words=OTHER_WORDS)


@pytest.fixture(scope="session")
def no_vocab_path(model_dir) -> Path:
    """A GGUF header without a tokenizer: a draft that cannot draft for anything, even through text."""
    return write_no_vocab(model_dir / "novocab.gguf")


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    p = REAL_MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not p.is_file():
        pytest.skip(f"real model absent: {p} (run ../shared/models/fetch-real-models.sh)")
    return p


@pytest.fixture(scope="session")
def long_model(tmp_path_factory) -> Path:
    """The tiny target with a 64k training context: room for a generation a test stops midway."""
    return write_model(tmp_path_factory.mktemp("long") / "long.gguf", 3, n_ctx_train=65536)


@pytest.fixture
def clean_config(tmp_path, monkeypatch):
    """A config dir per test, the hub offline, no LOCALSPEC_* setting from the caller's environment."""
    from helpers import clean_env

    clean_env(monkeypatch, tmp_path / "cfg")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def isolated_config(clean_config, tmp_path, monkeypatch):
    """clean_config, and a cache dir per test (exactness probes, locks)."""
    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def session(target_path, draft_path, tmp_path_factory):
    """A loaded Session on the tiny target and draft (draft, k 3), per test module: the server tests serve it."""
    from helpers import CTX, loaded_session

    with loaded_session({"model": str(target_path), "draft": str(draft_path), "method": "draft", "draft_tokens": 3,
                         "ctx_size": CTX}, tmp_path_factory.mktemp("cfg")) as sess:
        yield sess


@pytest.fixture(scope="module")
def open_api(session):
    """A server on `session` with the default configuration: loopback, no key, no web origins."""
    from helpers import serving
    from localspec.server.config import ServerConfig

    with serving(session, ServerConfig(queue_size=2)) as s:
        yield s


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A fresh HF cache, config and localspec cache, hub access allowed (the fake hub tests point HF_ENDPOINT)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("LOCALSPEC_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return tmp_path


def check_cancel_mid_batch(engine, batch, requests, steps: int, which: int = 1) -> None:
    """The requests `requests()` gives ((prompt text, GenConfig) each; a call gives new configs, as a grammar is
    consumed by the run that uses it) in `batch`, request `which` cancelled after `steps` steps: it ends "cancelled"
    with a prefix of its answer alone (its streamed pieces adding up to its text), and the others answer as alone."""
    import threading

    from localspec.core.engine import Finished, Piece

    seq = [engine.complete(engine.raw_prompt(p), c) for p, c in requests()]
    stop = threading.Event()
    results, pieces = {}, []
    for i, (p, c) in enumerate(requests()):
        def sink(ev, i=i):
            if isinstance(ev, Finished):
                results[i] = ev
            elif isinstance(ev, Piece) and i == which:
                pieces.append(ev.text)
        batch.add(engine.raw_prompt(p), c, cancel=stop if i == which else None, sink=sink)
    for _ in range(steps):
        batch.step()
    stop.set()
    while batch.active:
        batch.step()
    assert results[which].finish_reason == "cancelled"
    assert 0 < len(results[which].tokens) < len(seq[which].tokens)
    assert results[which].tokens == seq[which].tokens[:len(results[which].tokens)]
    assert "".join(pieces) == results[which].text
    for i in set(range(len(seq))) - {which}:
        assert results[i].tokens == seq[i].tokens
        assert results[i].finish_reason == seq[i].finish_reason


@pytest.fixture(scope="session")
def exact_batching(target_path):
    """(exact, why): BatchEngine's probe on the tiny target with 4 slots. Whether batched rows are bit-identical to
    one-token decoding is a property of the CPU's kernels, not of localspec: on a 2-core AMD EPYC with AVX512-BF16,
    BF16-KV flash attention sums a row differently when another request's cache in the pass is longer."""
    from localspec.core.batch import BatchEngine
    from localspec.core.engine import Engine

    e = Engine.load(target_path, n_ctx=1024)
    b = BatchEngine(e, 4, prefill_chunk=16)
    try:
        return b.probe()
    finally:
        b.close()
        e.close()


def require_exact_batching(res) -> None:
    """Tests of what `bit` requests keep under batching need a machine where batching can be bit-exact at all."""
    exact, why = res
    if not exact:
        pytest.skip(f"batching is not bit-exact with this CPU's kernels ({why}); the probe's verdict is checked "
                    "against a direct decode in test_batch.py")


@pytest.fixture
def fresh_suffix_cache(tmp_path, monkeypatch):
    """Its own cache dir and config, and no suffix corpus left in the process from another test (before and after)."""
    from helpers import clean_env
    from localspec.drafters import suffix_corpus as CO
    from localspec.store import suffixcache as SC

    clean_env(monkeypatch, tmp_path / "cfg")
    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "cache"))
    CO._CORPORA.clear()
    CO._STATIC.clear()
    SC._noticed.clear()
    yield
    CO._CORPORA.clear()
    CO._STATIC.clear()
