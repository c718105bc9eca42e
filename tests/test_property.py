"""The exactness property, over random requests and every drafter: at temperature 0 the answer under `bit` is plain
decoding's, token for token, whatever drafts and whatever the caches hold; under `lossless` every emitted token is
the target's argmax over the context it follows (a flip only at a near-tie of float rounding: no stale KV row, no
skipped position).

Each case is a random prompt (words, byte-fallback characters, a repeated span), a random length and sometimes a stop
string from the plain answer, and random histories in the suffix cache (earlier answers, the plain answer, text that
starts like it and goes wrong). It runs with every drafter: prompt lookup, the n-gram cache, the suffix cache, the
draft model, the draft model chained with the suffix cache, and an adversarial drafter that proposes a random length
(past the step's k too) of correct tokens followed by garbage. A random policy picks the drafter and k each step,
past the bit cap too, so the scheduler's own bounds are what keep `bit`; the adaptive controller runs on the same
cases with warm repeats. Caches are warm or cold at random: the target's and the draft model's KV (prefix reuse),
the prompt states (a quarter of the prompts pass the prefill chunk, whose start is kept and restored), the n-gram
counts and the suffix corpus. Requests run alone (N = 1) and four at once (N = 4).

LOCALSPEC_PROPERTY_CASES sets the random cases per test (CI's default below; benchmarks/property_long.sh runs more),
LOCALSPEC_PROPERTY_SEED the first seed; a failure names its seed.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from tinymodels import WORDS

CASES = int(os.environ.get("LOCALSPEC_PROPERTY_CASES", "40"))
SEED = int(os.environ.get("LOCALSPEC_PROPERTY_SEED", "0"))
TIE = 0.02  # logits: a lossless token may differ from plain decoding's only where the two top logits are this close
BIT_CAP = 2  # the bit cap the tests force (the tiny F16 models verify every width bit-exactly on most CPUs)
EXTRA = ["é", "ß", "→", "🦄", "🌈", "🔥", "👩\u200d👩\u200d👧", "🇫🇷", "✅", "{", "}", "\n", "  "]


# ------------------------------------------------------------------ random requests
def random_text(rng: np.random.Generator) -> str:
    """Words of the tiny vocabulary, characters it only has as bytes, and often a span repeated (a copy)."""
    out: list[str] = []
    for _ in range(int(rng.integers(3, 30))):
        r = rng.random()
        if r < 0.6:
            out.append(WORDS[int(rng.integers(len(WORDS)))].replace("▁", " "))
        else:
            out.append(EXTRA[int(rng.integers(len(EXTRA)))])
        if r > 0.93 and len(out) > 4:  # a repeated span: lookup and the caches find matches
            a = int(rng.integers(len(out) - 3))
            out.extend(out[a:a + int(rng.integers(2, 8))])
    return "".join(out)


class Case:
    """One request: its prompt tokens and config, and plain decoding's answer to it (the reference)."""

    def __init__(self, engine, seed: int) -> None:
        from localspec.core.engine import GenConfig

        rng = np.random.default_rng(seed)
        self.seed = seed
        self.prompt = engine.raw_prompt(random_text(rng))
        if rng.random() < 0.25:  # past the prefill chunk: the prompt cache keeps and restores its start
            n = int(engine.target.n_batch) + int(rng.integers(1, 120))
            while len(self.prompt) < n:
                self.prompt += engine.raw_prompt(random_text(rng))[1:]
            self.prompt = self.prompt[:n]
        self.max_tokens = int(rng.integers(4, 48))
        full = engine.complete(self.prompt, GenConfig(method="none", max_tokens=self.max_tokens))
        self.stop = None
        if full.text and rng.random() < 0.35:  # a stop string that the plain answer contains
            a = int(rng.integers(len(full.text)))
            self.stop = [full.text[a:a + int(rng.integers(1, 4))]]
        self.plain = engine.complete(self.prompt, self.cfg("none", "bit")) if self.stop else full
        self.rng = rng

    def cfg(self, method: str, exactness: str):
        from localspec.core.engine import GenConfig

        return GenConfig(method=method, k=4, max_tokens=self.max_tokens, exactness=exactness,
                         stop=self.stop or [])

    def histories(self, vocab: int) -> list[list[int]]:
        """Earlier requests the suffix cache may hold: this request's plain answer, the prompt with an answer that
        starts right and goes wrong, and random token runs."""
        rng, p, ans = self.rng, self.prompt, list(self.plain.tokens)
        cut = int(rng.integers(len(ans) + 1))
        wrong = ans[:cut] + [int(t) for t in rng.integers(5, vocab, size=int(rng.integers(1, 12)))]
        docs = [p + ans, p + wrong, [int(t) for t in rng.integers(5, vocab, size=int(rng.integers(4, 40)))]]
        return [docs[i] for i in rng.permutation(len(docs))[:int(rng.integers(0, 4))]]


# ------------------------------------------------------------------ drafters and policies
class AdversarialDrafter:
    """Knows plain decoding's answer and proposes a random number of its tokens followed by garbage, of a random
    length up to past the step's k: the verify must keep exactly the right prefix."""

    name = "adversarial"
    shadowed = False
    prior_alpha = 0.5

    def __init__(self, cases: list[Case], rng: np.random.Generator, n_vocab: int) -> None:
        self.cases, self.rng, self.n_vocab = cases, rng, n_vocab

    def _answer(self, context) -> list[int] | None:
        best = None
        for c in self.cases:
            n = len(c.prompt)
            if len(context) >= n and list(context[:n]) == c.prompt and (best is None or n > len(best.prompt)):
                best = c
        if best is None:
            return None
        return list(best.prompt) + list(best.plain.tokens)

    def offer(self, context, k):
        from localspec.drafters.base import Offer

        return Offer(k, self.name) if k > 0 else None

    def propose(self, context, k, sp, rng):
        from localspec.drafters.base import Proposal

        full = self._answer(context)
        n = int(self.rng.integers(0, k + 4))  # past k too
        right = full[len(context):] if full is not None and list(full[:len(context)]) == list(context) else []
        good = right[:int(self.rng.integers(0, n + 1))]
        bad = [int(t) for t in self.rng.integers(5, self.n_vocab, size=n - len(good))]
        return Proposal(good + bad, None)

    def begin(self, context):
        pass

    def accept(self, n_drafted, n_accepted):
        pass

    def after_target_decode(self, tokens, positions):
        pass

    def cost(self):
        return 0.0

    def lag(self, context):
        return 0

    def close(self):
        pass


class RandomPolicy:
    """Each step a random drafter of the request's (or none) and a random k up to twice the k asked for: what
    keeps `bit` is the scheduler's bound, not the policy's restraint."""

    switched = None

    def __init__(self, drafters: dict, k: int, rng: np.random.Generator) -> None:
        self.drafters, self.k, self.rng = drafters, k, rng

    def choose(self, context):
        names = sorted(self.drafters)
        if not names or self.rng.random() < 0.15:
            return None, 0
        return self.drafters[names[int(self.rng.integers(len(names)))]], int(self.rng.integers(1, 2 * self.k + 2))

    def observe(self, *a) -> None:
        pass

    def reason(self) -> str:
        return "random"

    def uncap(self, k: int) -> None:
        pass

    def set_verify_prices(self, ratios) -> None:
        pass


# ------------------------------------------------------------------ checks
def argmax_ok(engine, prompt: list[int], tokens: list[int]) -> tuple[bool, str]:
    """Whether each of `tokens` is the target's argmax (within TIE) decoding one token at a time after `prompt`."""
    t = engine.target
    row = t.sync(prompt)
    for i, tok in enumerate(tokens):
        top = float(np.max(row))
        if float(row[tok]) < top - TIE:
            return False, f"token {i} ({tok}) is {top - float(row[tok]):.3f} under the argmax {int(np.argmax(row))}"
        row = t.decode([tok])[0]
    return True, ""


def check(engine, case: Case, fin, level: str, what: str) -> None:
    plain = case.plain
    where = f"seed {case.seed}, {what}, {level}"
    if level == "bit":
        assert fin.tokens == plain.tokens, f"{where}: {fin.tokens} != plain {plain.tokens}"
        assert fin.text == plain.text, where
        assert fin.finish_reason == plain.finish_reason, where
        return
    if fin.tokens != plain.tokens:  # lossless: only a near-tie may flip, and each token stays the target's choice
        ok, why = argmax_ok(engine, case.prompt, list(fin.tokens))
        assert ok, f"{where}: {why}"


def bit_steps_within_cap(fin, cap: int, where: str) -> None:
    """Under bit no step verified more drafts than the cap (the stats' k per step)."""
    if fin.stats.exactness == "bit":
        wide = {k: n for k, n in fin.stats.k_used.items() if k > cap}
        assert not wide, f"{where}: steps past the bit cap {cap} at bit: {wide}"
        assert len(fin.stats.drafted_at) <= cap, f"{where}: {len(fin.stats.drafted_at)} drafts verified in one step"


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def capped(engine, tmp_path_factory):
    """The tiny engine with its bit cap forced to BIT_CAP drafts, a flat verify curve (drafting always pays, as on a
    GPU) and a prompt cache (a server's: memory over disk), restored after the module."""
    from localspec.core.prompt_cache import PromptCache, ServerStates
    from localspec.store.prompt_states import PromptStates

    saved = engine._probe, engine.verify_costs, engine.prompt_cache
    engine._probe = (64, BIT_CAP + 1)
    engine.verify_costs = lambda upto: {b: 1.0 for b in range(1, upto + 1)}
    engine.prompt_cache = PromptCache(ServerStates(1 << 28, PromptStates(root=tmp_path_factory.mktemp("states"))))
    yield engine
    engine._probe, engine.verify_costs, engine.prompt_cache = saved


@pytest.fixture
def scope(capped):
    """A suffix scope of the test's own (nothing from other tests or the user's cache)."""
    from localspec.drafters.suffix_corpus import private_scope, release_scope

    saved, s = capped.suffix_scope, private_scope()
    capped.suffix_scope = s
    yield s
    capped.suffix_scope = saved
    release_scope(s)


def warm_or_cold(engine, case: Case, scope: str, rng: np.random.Generator) -> None:
    """At random: the suffix corpus gets the case's histories; the target's and draft model's KV are cleared."""
    from localspec.drafters.suffix_corpus import Doc, corpus_for

    if rng.random() < 0.6:
        corpus = corpus_for(engine.target, scope)
        for i, doc in enumerate(case.histories(engine.target.n_vocab)):
            corpus.commit(Doc(f"h{case.seed}-{i}-{rng.integers(1 << 30)}", 0.0, doc))
    if rng.random() < 0.4:
        engine.target.truncate(0)
    if engine.draft is not None and rng.random() < 0.4:
        engine.draft.truncate(0)


def cases_for(engine, salt: int) -> list[Case]:
    return [Case(engine, SEED * 1000 + salt * 100 + i) for i in range(CASES)]


# ------------------------------------------------------------------ N = 1
def random_policy_runs(engine, cases: list[Case], rng: np.random.Generator, scope: str, monkeypatch) -> int:
    """Each case at bit and at lossless with a random policy over every drafter `engine` has for auto and the
    adversarial one, caches warm or cold at random; checked against plain decoding. Returns the tokens drafted."""
    adversary = AdversarialDrafter(cases, rng, engine.target.n_vocab)
    real = engine.make_policy

    def random_policy(cfg, exactness=None):
        _, label, k = real(cfg, exactness)
        drafters = dict(engine.drafters_for(cfg, "auto")) if k else {}
        if k:
            drafters["adversarial"] = adversary
        return RandomPolicy(drafters, max(k, 1), rng), label, k

    monkeypatch.setattr(engine, "make_policy", random_policy)
    restores = []
    real_restore = type(engine.target).restore_state

    def restore_state(model, tokens, data, *a, **kw):
        ok = real_restore(model, tokens, data, *a, **kw)
        restores.append(ok)
        return ok

    monkeypatch.setattr(type(engine.target), "restore_state", restore_state)
    drafted = 0
    for case in cases:
        for level in ("bit", "lossless"):
            warm_or_cold(engine, case, scope, rng)
            fin = engine.complete(case.prompt, case.cfg("auto", level))
            assert fin.stats.exactness == level
            bit_steps_within_cap(fin, BIT_CAP, f"seed {case.seed}")
            check(engine, case, fin, level, "random policy")
            drafted += fin.stats.drafted
    monkeypatch.undo()
    long_twice = sum(len(c.prompt) > engine.target.n_batch for c in cases)
    if engine.prompt_cache is not None and long_twice >= 3:  # a long prompt's start came back from the prompt cache
        assert any(restores), "no prompt state was restored"
    return drafted


def test_every_drafter_alone_gives_plain_decodings_answer(capped, scope, monkeypatch):
    """Random requests, each with a random policy over every drafter (the adversarial one included) at bit and at
    lossless, caches warm or cold at random: bit is plain decoding's answer, lossless the target's argmax."""
    drafted = random_policy_runs(capped, cases_for(capped, 1), np.random.default_rng(SEED + 11), scope, monkeypatch)
    assert drafted > 0  # the policy drafted: the property was tested, not plain decoding against itself


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("property-heads")


def _head_pair(kind: str, heads_dir, target_path, other_vocab_path):
    """(target, draft) paths of a pair whose drafter is `kind`: a draft model of another vocabulary, or a draft head
    (EAGLE-3, DFlash, DSpark beside a bigram target; MTP layers inside the target)."""
    import tinyheads as H

    if kind == "cross-vocab":
        return target_path, other_vocab_path
    if kind == "mtp":
        return H.write_glm4moe_mtp(heads_dir / "mtp.gguf", 7), None
    target = H.write_bigram_target(heads_dir / "bigram.gguf", 7)
    head = {"eagle3": lambda p: H.write_eagle3(p, 3, agree_with=7),
            "dflash": lambda p: H.write_dflash(p, 3, agree_with=7),
            "dspark": lambda p: H.write_dspark(p, 3, agree_with=7, wrong=0.2)}[kind](heads_dir / f"{kind}.gguf")
    return target, head


@pytest.mark.parametrize("kind", ["cross-vocab", "eagle3", "dflash", "dspark", "mtp"])
def test_other_drafters_give_plain_decodings_answer(kind, heads_dir, target_path, other_vocab_path, monkeypatch):
    """The drafters of other pairs (a draft model of another vocabulary, each draft head), with the request's other
    drafters and the adversarial one under a random policy: the same property."""
    from localspec.core.engine import Engine
    from localspec.drafters.suffix_corpus import private_scope, release_scope
    from localspec.llama import heads as LH

    if kind in ("eagle3", "dflash", "dspark", "mtp"):
        try:
            LH.require_head(kind)
        except Exception as exc:  # a llama.cpp build without the head's entry points
            pytest.skip(str(exc))
    target, draft = _head_pair(kind, heads_dir, target_path, other_vocab_path)
    monkeypatch.setenv("LOCALSPEC_NO_COST_CALIBRATION", "1")
    engine = Engine.load(target, draft, n_ctx=1024)
    engine._probe = (64, BIT_CAP + 1)
    engine.suffix_scope = scope = private_scope()
    try:
        want = {"cross-vocab": "draft", "dspark": "dflash"}.get(kind, kind)  # a DSpark head drafts as dflash
        from localspec.core.engine import GenConfig

        assert want in engine.drafters_for(GenConfig(), "auto")
        cases = cases_for(engine, 5)[:max(2, CASES // 2)]
        drafted = random_policy_runs(engine, cases, np.random.default_rng(SEED + 55), scope, monkeypatch)
        assert drafted > 0
    finally:
        engine.close()
        release_scope(scope)


def test_auto_with_warm_repeats_keeps_bit(capped, scope):
    """The adaptive controller at bit with every request's answer already in the suffix cache (repeats, which it may
    draft past k elsewhere): no step past the bit cap, plain decoding's answer; at auto, it may leave bit, and says
    so; at lossless, the target's argmax."""
    from localspec.drafters.suffix_corpus import Doc, corpus_for

    engine = capped
    cases = cases_for(engine, 2)
    corpus = corpus_for(engine.target, scope)
    for c in cases:
        corpus.commit(Doc(f"plain-{c.seed}", 0.0, c.prompt + list(c.plain.tokens)))
    repeats = 0
    for case in cases:
        for level in ("bit", "auto", "lossless"):
            fin = engine.complete(case.prompt, case.cfg("auto", level))
            bit_steps_within_cap(fin, BIT_CAP, f"seed {case.seed} ({level})")
            check(engine, case, fin, fin.stats.exactness, f"auto at {level}")
            if level == "bit":
                assert fin.stats.exactness == "bit"
                repeats += fin.stats.drafted
    assert repeats > 0


@pytest.mark.parametrize("method", ["lookup", "ngram", "suffix", "draft"])
def test_each_drafter_alone_past_k(capped, scope, method):
    """One drafter alone (FixedPolicy) at k = 8 under bit: k is the cap, and the answer plain decoding's."""
    engine = capped
    for case in cases_for(engine, 3)[:max(2, CASES // 3)]:
        warm_or_cold(engine, case, scope, case.rng)
        cfg = dataclasses.replace(case.cfg(method, "bit"), k=8)
        fin = engine.complete(case.prompt, cfg)
        assert fin.stats.k_cap <= BIT_CAP
        bit_steps_within_cap(fin, BIT_CAP, f"seed {case.seed} ({method})")
        check(engine, case, fin, "bit", method)


# ------------------------------------------------------------------ N = 4
def test_four_at_once_give_plain_decodings_answers(capped, scope, monkeypatch):
    """Four requests in one batch (continuous batching, one pass a step), each with a random policy over the slot's
    drafters and the adversarial one, at bit and at lossless: each answer is its plain decoding's (bit, while the
    request shares only bit-exact passes), else each token the target's argmax."""
    from localspec.core import batch as B
    from localspec.core.batch import BatchEngine

    engine = capped
    cases = cases_for(engine, 4)
    rng = np.random.default_rng(SEED + 44)
    adversary = AdversarialDrafter(cases, rng, engine.target.n_vocab)
    real = B.build_policy

    def random_policy(cfg, method, k, drafters, state, costs=None):
        _, label = real(cfg, method, k, drafters, state, costs)
        if not k:
            return _, label
        return RandomPolicy({**drafters, "adversarial": adversary}, k, rng), label

    monkeypatch.setattr(B, "build_policy", random_policy)
    b = BatchEngine(engine, 4, prefill_chunk=16)
    try:
        for level in ("bit", "lossless"):
            for case in cases:
                warm_or_cold(engine, case, scope, rng)
            reqs = [(c.prompt, c.cfg("auto", level)) for c in cases]
            fins = b.generate_all(reqs)
            for case, fin in zip(cases, fins):
                bit_steps_within_cap(fin, BIT_CAP, f"seed {case.seed} (N=4)")
                check(engine, case, fin, fin.stats.exactness, "N=4 random policy")
    finally:
        b.close()
