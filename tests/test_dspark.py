"""DSpark heads (DFlash plus a Markov head, llama.cpp's `draft-dspark`) as localspec runs them.

No real DSpark weights are reachable here: every head below is fabricated (tinyheads.write_dspark) on the bigram
target, with a Markov head whose successor scores outweigh the backbone's logits by a wide margin, so llama.cpp's
in-graph argmax chain and localspec's reading of it cannot disagree on a rounding. The acceptance figures are
checked against llama.cpp's own `llama-speculative-simple` on the same files where that binary is installed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tinyheads import N, PROMPTS, check_block_head_in_auto_and_long_prompts, check_head_width_mismatch, plain_tokens, \
    write_bigram_target, write_dflash, write_dspark

NATIVE = Path.home() / ".cache" / "localspec-anchor" / "build" / "bin" / "llama-speculative-simple"


@pytest.fixture(autouse=True)
def _no_cost_calibration(monkeypatch):
    """These tests check outputs and counts, not speed: skip the verify-cost timing."""
    monkeypatch.setenv("LOCALSPEC_NO_COST_CALIBRATION", "1")


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dspark")


@pytest.fixture(scope="module")
def bigram(heads_dir) -> Path:
    return write_bigram_target(heads_dir / "bigram.gguf", 7)


@pytest.fixture(scope="module")
def dspark_exact(heads_dir) -> Path:
    """Every Markov successor is the target's: each chained draft is right."""
    return write_dspark(heads_dir / "dspark-exact.gguf", 3, agree_with=7)


@pytest.fixture(scope="module")
def dspark_agree(heads_dir) -> Path:
    """A fifth of the successors are wrong: drafts are accepted up to the first wrong one, then rolled back."""
    return write_dspark(heads_dir / "dspark-agree.gguf", 3, agree_with=7, wrong=0.2)


@pytest.fixture(scope="module")
def dspark_random(heads_dir) -> Path:
    return write_dspark(heads_dir / "dspark-random.gguf", 11)


_plain = plain_tokens


def _run(engine, prompt, n=N, **kw):
    from localspec.core.engine import GenConfig

    kw = {"method": "dflash", "k": 8, "p_min": 0.0, "exactness": "lossless", **kw}
    return engine.complete(engine.raw_prompt(prompt), GenConfig(max_tokens=n, **kw))


# ----------------------------------------------------------------- detection
def test_a_dspark_head_is_told_from_a_dflash_head_by_its_markov_head(heads_dir, bigram, dspark_agree):
    from localspec.core.engine import Engine
    from localspec.drafters.dflash import DFlashDrafter
    from localspec.drafters.dspark import DSparkDrafter
    from localspec.llama.heads import HEAD_ARCHS, file_arch

    dflash = write_dflash(heads_dir / "dflash.gguf", 3, agree_with=7)
    assert HEAD_ARCHS[file_arch(dspark_agree)] == "dflash"  # the same architecture: the tensors tell them apart
    assert DSparkDrafter.in_file(dspark_agree) and not DSparkDrafter.in_file(dflash)
    from localspec.models.gguf_header import drafter_words, read_file_metadata

    assert "a DSpark draft head" in drafter_words(read_file_metadata(dspark_agree), "draft")
    assert "DSpark" not in drafter_words(read_file_metadata(dflash), "draft")
    for path, cls in ((dspark_agree, DSparkDrafter), (dflash, DFlashDrafter)):
        e = Engine.load(bigram, path, n_ctx=512)
        try:
            assert type(e.heads["dflash"]) is cls and e.draft_kind == "head"
        finally:
            e.close()


# ----------------------------------------------------------------- exactness and acceptance
@pytest.mark.parametrize("exactness", ["lossless", "auto"])
def test_random_dspark_head_output_identical_to_plain(bigram, dspark_random, exactness):
    from localspec.core.engine import Engine

    e = Engine.load(bigram, dspark_random, n_ctx=512)
    try:
        for prompt in PROMPTS:
            r = _run(e, prompt, k=4, exactness=exactness)
            assert r.tokens == _plain(bigram, prompt), prompt
            assert r.stats.method == "dflash" and r.stats.drafted > 0
    finally:
        e.close()


def test_the_markov_chain_drafts_whole_blocks(bigram, dspark_exact):
    """A DFlash head gets only the first token of a block right on this target (its rows cannot see each other's
    guesses); the Markov head chains them, so with every successor right each whole block of 8 is accepted."""
    from localspec.core.engine import Engine

    e = Engine.load(bigram, dspark_exact, n_ctx=512)
    try:
        for prompt in PROMPTS:
            r = _run(e, prompt)
            assert r.tokens == _plain(bigram, prompt), prompt
            assert r.stats.accepted == r.stats.drafted and len(r.stats.accepted_at) == 8
            assert r.stats.accepted_at[7] >= 3  # at least three whole blocks of 8
    finally:
        e.close()


def test_an_agreeing_head_accepts_and_rolls_back(bigram, dspark_agree):
    from localspec.core.engine import Engine

    e = Engine.load(bigram, dspark_agree, n_ctx=512)
    try:
        for prompt in PROMPTS:
            plain = _plain(bigram, prompt)
            r = _run(e, prompt)
            assert r.tokens == plain, prompt
            assert 0 < r.stats.accepted < r.stats.drafted
            r = _run(e, prompt, k=1)
            assert r.tokens == plain, prompt
            assert r.stats.accepted > 0
        assert e.heads["dflash"].hook_calls > 0
    finally:
        e.close()


def test_the_confidence_head_ends_drafts_before_a_wrong_successor(heads_dir, bigram):
    """The fabricated confidence head reads the flag its Markov head sets for a wrong successor: with p_min > 0
    the draft stops there (every drafted token accepted); with p_min 0 it is not consulted (rejections)."""
    from localspec.core.engine import Engine

    path = write_dspark(heads_dir / "dspark-conf.gguf", 3, agree_with=7, wrong=0.2, conf=True)
    e = Engine.load(bigram, path, n_ctx=512)
    try:
        assert e.heads["dflash"].has_conf
        for prompt in PROMPTS:
            plain = _plain(bigram, prompt)
            r = _run(e, prompt, p_min=0.75)
            assert r.tokens == plain and 0 < r.stats.accepted == r.stats.drafted, prompt
            r = _run(e, prompt, p_min=0.0)
            assert r.tokens == plain and r.stats.accepted < r.stats.drafted, prompt
    finally:
        e.close()


@pytest.mark.parametrize("anchor,k_max", [(True, 3), (None, 3), (False, 2)])
def test_the_block_layout_caps_k(heads_dir, bigram, anchor, k_max):
    """Anchor-first (dflash.sample_from_anchor true, or absent) drafts block_size tokens from [pending, mask x
    (k-1)]; the bonus-anchor layout (false) drafts block_size - 1 from [pending, mask x k], as DFlash does."""
    from localspec.core.engine import Engine

    path = write_dspark(heads_dir / f"dspark-b3-{anchor}.gguf", 3, agree_with=7, block_size=3,
                        sample_from_anchor=anchor)
    e = Engine.load(bigram, path, n_ctx=512)
    try:
        assert e.heads["dflash"].k_max == k_max
        r = _run(e, PROMPTS[0], k=6)
        assert r.tokens == _plain(bigram, PROMPTS[0])
        assert r.stats.accepted == r.stats.drafted  # every successor right: the layout lines up with the chain
        steps = r.stats.drafting_steps
        assert (k_max - 1) * steps < r.stats.drafted <= k_max * steps
    finally:
        e.close()


def test_auto_long_prompt_and_sampling(bigram, dspark_agree):
    from localspec.drafters.dspark import DSparkDrafter

    check_block_head_in_auto_and_long_prompts(bigram, dspark_agree, DSparkDrafter, 8)


# ----------------------------------------------------------------- refusals
def test_each_drafter_refuses_the_other_kind_of_file(heads_dir, bigram, dspark_agree):
    from localspec.drafters.dflash import DFlashDrafter
    from localspec.drafters.dspark import DSparkDrafter
    from localspec.errors import IncompatibleDraftError
    from localspec.llama.model import Model

    dflash = write_dflash(heads_dir / "dflash-other.gguf", 3, agree_with=7)
    with Model(bigram, n_ctx=512) as t:
        with pytest.raises(IncompatibleDraftError) as e:
            DFlashDrafter.load(t, dspark_agree)
        assert str(e.value) == (f"{dspark_agree.name} is a DSpark head (DFlash plus a Markov head), "
                                "not a plain DFlash head")
        with pytest.raises(IncompatibleDraftError) as e:
            DSparkDrafter.load(t, dflash)
        assert str(e.value) == f"{dflash.name} is a plain DFlash head (no Markov head), not a DSpark head"


def test_a_build_without_the_confidence_read_refuses_dspark_only(monkeypatch, heads_dir, bigram, dspark_agree):
    from localspec.core.engine import Engine
    from localspec.errors import IncompatibleDraftError
    from localspec.llama import ext

    monkeypatch.setattr(ext, "_missing", ["llama_get_embeddings_nextn"])
    avail = ext.heads_available()
    assert avail["dflash"] is None and "llama_get_embeddings_nextn" in avail["dspark"]
    with pytest.raises(IncompatibleDraftError, match=r"^a DSpark head \(--method dflash\) is unavailable: .*lacks "
                                                     r"llama_get_embeddings_nextn"):
        Engine.load(bigram, dspark_agree, n_ctx=512)
    e = Engine.load(bigram, write_dflash(heads_dir / "dflash-still.gguf", 3, agree_with=7), n_ctx=512)
    try:
        assert "dflash" in e.heads
    finally:
        e.close()


def test_unsupported_target_arch_is_one_error_line(heads_dir, dspark_agree):
    q2 = write_bigram_target(heads_dir / "qwen2-dspark.gguf", 7, arch="qwen2")
    r = subprocess.run([sys.executable, "-m", "localspec", "run", "-m", str(q2), "-d", str(dspark_agree),
                        "--method", "dflash", "-n", "4", "--raw", "the cat"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "DSpark" in lines[0] and "qwen2" in lines[0], r.stderr


def test_a_head_for_another_target_width_is_refused_and_auto_falls_back(heads_dir):
    """A DSpark head made for a 64-wide target beside a 128-wide one: named at load, as DFlash and EAGLE-3 are."""
    from localspec.drafters.dspark import DSparkDrafter

    wide = write_bigram_target(heads_dir / "bigram-128.gguf", 7, n_embd=128)
    check_head_width_mismatch(wide, write_dspark(heads_dir / "dspark-64.gguf", 11), DSparkDrafter, "dflash")


# ----------------------------------------------------------------- against llama.cpp
def _native(target: Path, head: Path, prompt: str, n: int, p_min: float) -> tuple[int, int, int]:
    """(n_predict, n_drafted, n_accept) of llama.cpp's llama-speculative-simple with `head` as a draft-dspark head.
    The tool now and then exits 0 without its closing figures (its log thread loses the last lines): it is run
    again, up to three times, for the same deterministic run."""
    for _ in range(3):
        r = subprocess.run([str(NATIVE), "-m", str(target), "-md", str(head), "--spec-type", "draft-dspark",
                            "-p", prompt, "-n", str(n), "--temp", "0", "--spec-draft-n-max", "8",
                            "--spec-draft-p-min", str(p_min), "-t", "2", "-c", "1024"],
                           capture_output=True, text=True, errors="replace", timeout=300)
        out = r.stdout + r.stderr
        assert r.returncode == 0 and "adding speculative implementation 'draft-dspark'" in out, out[-2000:]
        found = [re.search(rf"{key}\s*=\s*(\d+)", out) for key in ("n_predict", "n_drafted", "n_accept")]
        if all(found):
            return tuple(int(m.group(1)) for m in found)
    raise AssertionError(f"llama-speculative-simple printed no figures: {out[-2000:]}")


@pytest.mark.skipif(not NATIVE.is_file(), reason=f"llama.cpp's llama-speculative-simple is not built at {NATIVE}")
@pytest.mark.parametrize("which", ["anchor", "bonus", "conf"])
def test_acceptance_per_drafted_token_matches_llama_cpp(heads_dir, bigram, which):
    """The same target and head files through llama.cpp's own speculative loop (greedy, n_max 8) and through
    localspec (k 8, as many tokens as llama.cpp generated): accepted per drafted token within 3 points, pooled over
    the prompts (the two differ only in how the last block before the token limit is cut)."""
    from localspec.core.engine import Engine

    head = write_dspark(heads_dir / f"dspark-native-{which}.gguf", 3, agree_with=7, wrong=0.2,
                        sample_from_anchor=which != "bonus", conf=which == "conf")
    p_min = 0.75 if which == "conf" else 0.0
    nat = [0, 0]
    loc = [0, 0]
    e = Engine.load(bigram, head, n_ctx=1024)
    try:
        for prompt in PROMPTS:
            n_predict, drafted, accepted = _native(bigram, head, prompt, 120, p_min)
            nat[0] += drafted
            nat[1] += accepted
            r = _run(e, prompt, n=n_predict, p_min=p_min)
            loc[0] += r.stats.drafted
            loc[1] += r.stats.accepted
    finally:
        e.close()
    assert nat[0] > 0 and loc[0] > 0
    assert abs(loc[1] / loc[0] - nat[1] / nat[0]) <= 0.03, (loc, nat)


def test_run_json_names_the_head_that_drafted(bigram, dspark_agree):
    """`run --json` says which kind of drafting ran: a DSpark file drafts as --method dflash, and the report names it."""
    from localspec.core.engine import Engine, GenConfig
    from localspec.core.report import run_json as result_json

    e = Engine.load(bigram, dspark_agree, n_ctx=512)
    try:
        cfg = GenConfig(method="dflash", k=4, max_tokens=N)
        fin = e.complete(e.raw_prompt(PROMPTS[0]), cfg)
        d = result_json(fin, fin.stats, e, cfg)
        assert d["draft_kind"] == "head" and d["draft_head"] == "DSpark" and d["steps_by_method"].get("dflash")
        none = GenConfig(method="none", max_tokens=8)
        fin = e.complete(e.raw_prompt(PROMPTS[0]), none)
        assert result_json(fin, fin.stats, e, none)["draft_head"] is None  # nothing drafted
    finally:
        e.close()
