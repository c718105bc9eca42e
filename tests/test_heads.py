"""llama.cpp's own draft heads as localspec drafters: the llama-ext.h bindings, the refusals that keep the process
alive, and EAGLE-3 on fabricated models (output identical to plain decoding with random heads and with a head that
agrees with the target, so acceptances and rollbacks really happen)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tinyheads import (N, PROMPTS, check_block_head_in_auto_and_long_prompts, check_head_width_mismatch, plain_tokens,
                       write_bigram_target, write_dflash, write_eagle3, write_glm4moe_mtp, write_mimo2_mtp,
                       write_qwen35_mtp)
from tinymodels import greedy_margins, write_model



@pytest.fixture(autouse=True)
def _no_cost_calibration(monkeypatch):
    """These tests check outputs, not speed: skip the verify-cost timing (for this file's tests only; set at import,
    it leaked into every test collected after it)."""
    monkeypatch.setenv("LOCALSPEC_NO_COST_CALIBRATION", "1")



@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("heads")


@pytest.fixture(scope="module")
def random4(heads_dir) -> Path:
    """A random llama target with 4 layers whose greedy top-2 margins are wide on the test prompts."""
    from localspec.llama.model import Model

    for seed in range(1, 40):
        path = write_model(heads_dir / "random4.gguf", seed, n_layer=4)
        with Model(path, n_ctx=512) as m:
            if min(greedy_margins(m, m.tokenize(p), N + 8)[1] for p in PROMPTS) >= 0.05:
                return path
    raise RuntimeError("no seed with wide margins")


@pytest.fixture(scope="module")
def random_head(heads_dir) -> Path:
    return write_eagle3(heads_dir / "eagle3-random.gguf", 11)


@pytest.fixture(scope="module")
def bigram(heads_dir) -> Path:
    return write_bigram_target(heads_dir / "bigram.gguf", 7)


@pytest.fixture(scope="module")
def agreeing_head(heads_dir) -> Path:
    return write_eagle3(heads_dir / "eagle3-agree.gguf", 3, agree_with=7)


_plain = plain_tokens


def test_struct_offsets_match_llama_h():
    """llama-cpp-python's ctypes structs put the head fields where llama.h (0.3.36) does."""
    from localspec.llama import ext
    from localspec.llama.lib import ll

    assert ll.llama_model_params.load_mtp.offset == 77 and ctypes.sizeof(ll.llama_model_params) == 80
    assert ll.llama_context_params.ctx_type.offset == 36
    assert ll.llama_context_params.ctx_other.offset == 152 and ctypes.sizeof(ll.llama_context_params) == 160
    assert ext.layout_ok() is None


def test_this_build_has_every_symbol():
    from localspec.llama import ext

    assert ext.missing() == []
    assert ext.heads_available() == {"eagle3": None, "mtp": None, "dflash": None, "dspark": None}


def test_missing_symbol_makes_the_head_unavailable_and_others_still_work(monkeypatch, bigram, agreeing_head):
    from localspec.core.engine import Engine, GenConfig
    from localspec.errors import IncompatibleDraftError
    from localspec.llama import ext

    monkeypatch.setattr(ext, "_missing", ["llama_get_embeddings_layer_inp"])
    why = ext.heads_available()
    assert why["eagle3"] and "llama_get_embeddings_layer_inp" in why["eagle3"]
    assert why["mtp"] is None
    with pytest.raises(IncompatibleDraftError, match="--method eagle3 is unavailable"):
        Engine.load(bigram, agreeing_head, n_ctx=512)
    e = Engine.load(bigram, agreeing_head, n_ctx=512, drop_incompatible_draft=True)  # auto: keeps going
    try:
        assert "unavailable" in e.dropped_draft and not e.heads
        out = e.complete(e.raw_prompt(PROMPTS[0]), GenConfig(method="lookup", max_tokens=N)).tokens
    finally:
        e.close()
    assert out == _plain(bigram, PROMPTS[0])


def test_unsupported_target_arch_is_refused_with_one_line(heads_dir, agreeing_head):
    """qwen2's graph does not fill layer_inp: llama.cpp aborts the process if the flag is set; localspec refuses
    the pair before, with one error line and exit 1 (no abort, no traceback)."""
    q2 = write_bigram_target(heads_dir / "qwen2.gguf", 7, arch="qwen2")
    r = subprocess.run([sys.executable, "-m", "localspec", "run", "-m", str(q2), "-d", str(agreeing_head),
                        "--method", "eagle3", "-n", "4", "--raw", "the cat"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "qwen2" in lines[0], r.stderr
    assert "aborted" not in r.stderr and "Traceback" not in r.stderr


def test_unsupported_target_arch_in_process(heads_dir, agreeing_head):
    from localspec.drafters.eagle3 import Eagle3Drafter
    from localspec.errors import IncompatibleDraftError
    from localspec.llama.model import Model

    q2 = write_bigram_target(heads_dir / "qwen2b.gguf", 7, arch="qwen2")
    with Model(q2, n_ctx=256) as t:
        with pytest.raises(IncompatibleDraftError, match="qwen2"):
            Eagle3Drafter.load(t, agreeing_head)
        t.decode([1, 5, 6])  # no flag was set: the target still decodes


# ----------------------------------------------------------------- EAGLE-3
def test_head_is_detected_from_the_file(bigram, agreeing_head, random_head):
    from localspec.llama.heads import file_arch

    assert file_arch(agreeing_head) == "eagle3" and file_arch(random_head) == "eagle3"
    assert file_arch(bigram) == "llama"


def test_extraction_flags_leave_target_logits_bit_identical(random4, random_head):
    import numpy as np

    from localspec.drafters.eagle3 import Eagle3Drafter
    from localspec.llama.model import Model

    with Model(random4, n_ctx=512) as t:
        p = t.tokenize(PROMPTS[1])
        before = [t.decode(p, "all")]
        before.append(t.decode([5, 6, 7, 8], "all"))
        t.clear()
        d = Eagle3Drafter.load(t, random_head)  # sets the layer-input flags on the target's context
        try:
            after = [t.decode(p, "all"), t.decode([5, 6, 7, 8], "all")]
        finally:
            d.close()
    for a, b in zip(before, after):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("exactness", ["lossless", "auto"])
def test_random_head_output_identical_to_plain(random4, random_head, exactness):
    from localspec.core.engine import Engine, GenConfig

    e = Engine.load(random4, random_head, n_ctx=512)
    try:
        assert list(e.heads) == ["eagle3"]
        for prompt in PROMPTS:
            cfg = GenConfig(method="eagle3", max_tokens=N, k=4, p_min=0.0, exactness=exactness)
            r = e.complete(e.raw_prompt(prompt), cfg)
            assert r.tokens == _plain(random4, prompt), prompt
            assert r.stats.method == "eagle3"
    finally:
        e.close()


def test_agreeing_head_accepts_and_rolls_back(bigram, agreeing_head):
    from localspec.core.engine import Engine, GenConfig

    e = Engine.load(bigram, agreeing_head, n_ctx=512)
    try:
        for prompt in PROMPTS:
            r = e.complete(e.raw_prompt(prompt), GenConfig(method="eagle3", max_tokens=N, k=3, p_min=0.0,
                                                            exactness="lossless"))
            assert r.tokens == _plain(bigram, prompt), prompt
            s = r.stats
            assert s.accepted > 0, "the head agrees with the target: its first token must be accepted"
            assert s.drafted > s.accepted, "its later tokens are wrong: rollbacks must happen"
            assert s.method_used["eagle3"] > 0
        d = e.heads["eagle3"]
        assert d.hook_calls > 0
    finally:
        e.close()


def test_auto_uses_the_head_and_stays_exact(bigram, agreeing_head):
    from localspec.core.engine import Engine, GenConfig

    e = Engine.load(bigram, agreeing_head, n_ctx=512)
    try:
        cfg = GenConfig(method="auto", max_tokens=N, k=3, exactness="lossless")
        assert "eagle3" in e.drafters_for(cfg, "auto")
        r = e.complete(e.raw_prompt(PROMPTS[2]), cfg)
        assert r.tokens == _plain(bigram, PROMPTS[2])
    finally:
        e.close()


def test_long_prompt_in_chunks_and_sampling(bigram, agreeing_head):
    """A prompt longer than n_batch (the hook sees only the last chunk's hidden states) and temperature > 0 (the
    head's distribution goes through the same rejection sampling)."""
    from localspec.core.engine import Engine, GenConfig
    from localspec.sample.sampling import SamplingParams
    from localspec.drafters.eagle3 import Eagle3Drafter
    from localspec.llama.model import Model

    t = Model(bigram, n_ctx=512, n_batch=16)
    e = Engine(t)
    e.heads["eagle3"] = Eagle3Drafter.load(t, agreeing_head)
    try:
        prompt = e.raw_prompt(" ".join(PROMPTS * 3))
        assert len(prompt) > 16
        r = e.complete(prompt, GenConfig(method="eagle3", max_tokens=N, k=3, p_min=0.0, exactness="lossless"))
        assert r.tokens == _plain(bigram, " ".join(PROMPTS * 3))
        assert r.stats.accepted > 0
        r = e.complete(prompt, GenConfig(method="eagle3", max_tokens=N, k=3, p_min=0.0, exactness="lossless",
                                         sampling=SamplingParams(temperature=0.8, seed=5)))
        assert len(r.tokens) == N and r.stats.drafted > 0
    finally:
        e.close()


def test_method_eagle3_without_a_head_is_a_setting_error(bigram):
    from localspec.core.engine import Engine, GenConfig
    from localspec.errors import SettingError

    e = Engine.load(bigram, n_ctx=512)
    try:
        with pytest.raises(SettingError, match="eagle3"):
            e.resolve_method(GenConfig(method="eagle3"))
    finally:
        e.close()


# ----------------------------------------------------------------- MTP
@pytest.fixture(scope="module")
def mtp_agree(heads_dir) -> Path:
    return write_glm4moe_mtp(heads_dir / "glm-mtp.gguf", 7)  # wrong for 30% of the tokens


@pytest.fixture(scope="module")
def mtp_perfect(heads_dir) -> Path:
    return write_glm4moe_mtp(heads_dir / "glm-mtp-perfect.gguf", 7, wrong=0.0)


@pytest.fixture(scope="module")
def mtp_random(heads_dir) -> Path:
    return write_glm4moe_mtp(heads_dir / "glm-mtp-random.gguf", 7, mtp="random")


def _mtp_run(path, prompt, **kw):
    from localspec.core.engine import Engine, GenConfig

    e = Engine.load(path, n_ctx=512)
    try:
        assert list(e.heads) == ["mtp"], e.heads_unavailable
        cfg = GenConfig(**{"method": "mtp", "max_tokens": N, "k": 4, "p_min": 0.0, "exactness": "lossless", **kw})
        r = e.complete(e.raw_prompt(prompt), cfg)
        plain = e.complete(e.raw_prompt(prompt), GenConfig(method="none", max_tokens=N)).tokens
        return r, plain
    finally:
        e.close()


def test_mtp_is_detected_from_the_target(mtp_agree, bigram):
    from localspec.llama.heads import file_nextn

    assert file_nextn(mtp_agree) == 1 and file_nextn(bigram) == 0


@pytest.mark.parametrize("which", ["random", "agree", "perfect"])
def test_mtp_output_identical_to_plain(which, mtp_random, mtp_agree, mtp_perfect, bigram):
    path = {"random": mtp_random, "agree": mtp_agree, "perfect": mtp_perfect}[which]
    for prompt in PROMPTS:
        r, plain = _mtp_run(path, prompt)
        assert r.tokens == plain == _plain(bigram, prompt), prompt  # the glm4moe trunk is the bigram target
        s = r.stats
        if which == "agree":
            assert s.accepted > 0 and s.drafted > s.accepted  # acceptances and rollbacks
        if which == "perfect":  # a layer that is always right: every drafted token accepted (plumbing exact)
            assert s.drafted > 0 and s.accepted == s.drafted


def test_mtp_flags_leave_target_logits_bit_identical(mtp_agree):
    import numpy as np

    from localspec.drafters.mtp import MtpDrafter
    from localspec.llama.model import Model

    with Model(mtp_agree, n_ctx=512, load_mtp=True) as t:
        p = t.tokenize(PROMPTS[0])
        before = [t.decode(p, "all"), t.decode([5, 6, 7], "all"), t.decode([9], "last")]
        t.clear()
        d = MtpDrafter.load(t)
        try:
            after = [t.decode(p, "all"), t.decode([5, 6, 7], "all"), t.decode([9], "last")]
        finally:
            d.close()
    for a, b in zip(before, after):
        assert np.array_equal(a, b)


def test_mtp_in_auto_and_with_sampling(mtp_agree):
    from localspec.sample.sampling import SamplingParams

    r, plain = _mtp_run(mtp_agree, PROMPTS[1], method="auto")
    assert r.tokens == plain
    r, _ = _mtp_run(mtp_agree, PROMPTS[1], sampling=SamplingParams(temperature=0.7, seed=3))
    assert len(r.tokens) == N and r.stats.drafted > 0


def test_mtp_missing_symbol_leaves_plain_decoding(monkeypatch, mtp_agree):
    from localspec.core.engine import Engine, GenConfig
    from localspec.errors import IncompatibleDraftError
    from localspec.llama import ext

    monkeypatch.setattr(ext, "_missing", ["llama_get_embeddings_nextn"])
    e = Engine.load(mtp_agree, n_ctx=512)
    try:
        assert not e.heads and "unavailable" in e.heads_unavailable["mtp"]
        with pytest.raises(IncompatibleDraftError, match="--method mtp is unavailable"):
            e.resolve_method(GenConfig(method="mtp"))
        assert len(e.complete(e.raw_prompt("the"), GenConfig(method="lookup", max_tokens=8)).tokens) == 8
    finally:
        e.close()


def test_method_mtp_on_a_target_without_mtp_layers(bigram):
    from localspec.core.engine import Engine, GenConfig
    from localspec.errors import SettingError

    e = Engine.load(bigram, n_ctx=512)
    try:
        with pytest.raises(SettingError, match="no MTP|MTP layers"):
            e.resolve_method(GenConfig(method="mtp"))
    finally:
        e.close()


# ----------------------------------------------------------------- several MTP layers
@pytest.mark.parametrize("layers", [("agree", "agree"), ("agree", "random"), ("random", "agree")])
def test_chained_mtp_layers(heads_dir, bigram, layers):
    """A mimo2 target with two MTP layers: draft step i runs layer i (llama_set_nextn_layer_offset). Both right:
    everything drafted is accepted and k is capped at 2; the second random: exactly the first of each draft is
    accepted (with one layer driven for both steps, all would be); the first random: nothing is."""
    path = write_mimo2_mtp(heads_dir / f"mimo2-{'-'.join(layers)}.gguf", 7, mtp=layers)
    for prompt in PROMPTS[:2]:
        r, plain = _mtp_run(path, prompt, k=4)
        assert r.tokens == plain == _plain(bigram, prompt), prompt
        s = r.stats
        assert s.drafted > 0 and s.drafted <= 2 * s.drafting_steps
        if layers == ("agree", "agree"):
            assert s.accepted == s.drafted
        elif layers == ("agree", "random"):
            assert s.drafted == 2 * s.drafting_steps and s.accepted == s.drafting_steps
        else:
            assert s.accepted == 0


def test_chained_mtp_with_sampling(heads_dir):
    from localspec.sample.sampling import SamplingParams

    path = write_mimo2_mtp(heads_dir / "mimo2-sampling.gguf", 7)
    r, _ = _mtp_run(path, PROMPTS[0], k=2, sampling=SamplingParams(temperature=0.7, seed=3))
    assert len(r.tokens) == N and r.stats.accepted > 0


def test_several_mtp_layers_on_a_one_layer_graph_are_refused(heads_dir):
    """glm4moe's MTP graph asserts one MTP layer (an abort): a 2-layer target is refused in one line with --method
    mtp, and auto decodes without it."""
    path = write_glm4moe_mtp(heads_dir / "glm-mtp2.gguf", 7, n_mtp=2)
    base = [sys.executable, "-m", "localspec", "run", "-m", str(path), "-n", "4", "--raw", "the cat"]
    r = subprocess.run(base + ["--method", "mtp"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "2 MTP layers" in lines[0], r.stderr
    assert "Traceback" not in r.stderr and "aborted" not in r.stderr
    r = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


# ----------------------------------------------------------------- MTP on a hybrid target
@pytest.fixture(scope="module")
def q35_mtp(heads_dir) -> dict:
    """qwen35 hybrids (gated delta net + attention, one MTP layer): the arch Qwen3.5's MTP models ship as."""
    return {"agree": write_qwen35_mtp(heads_dir / "q35-mtp.gguf", 7),
            "perfect": write_qwen35_mtp(heads_dir / "q35-mtp-perfect.gguf", 7, wrong=0.0),
            "random": write_qwen35_mtp(heads_dir / "q35-mtp-random.gguf", 7, mtp="random")}


@pytest.mark.parametrize("rollback", ["rs", "checkpoint"])
@pytest.mark.parametrize("which", ["random", "agree", "perfect"])
def test_mtp_on_a_hybrid_target(which, rollback, q35_mtp, bigram, monkeypatch):
    """The MTP context is a plain KV cache on the nextn layer (as llama.cpp makes it for qwen35); the target's
    recurrent state rolls back through Model.truncate (RS planes, or checkpoints and a replay the hook sees)."""
    from localspec.core.engine import Engine

    if rollback == "checkpoint":
        monkeypatch.setenv("LOCALSPEC_ROLLBACK", "checkpoint")
    e = Engine.load(q35_mtp[which], n_ctx=512)
    try:
        assert e.target.is_hybrid and e.target.rollback_kind == rollback
    finally:
        e.close()
    for prompt in PROMPTS[:2]:
        r, plain = _mtp_run(q35_mtp[which], prompt)
        assert r.tokens == plain == _plain(bigram, prompt), prompt  # the trunk adds nothing to the bigram target
        s = r.stats
        if which == "agree":
            assert s.accepted > 0 and s.drafted > s.accepted
        if which == "perfect":
            assert s.drafted > 0 and s.accepted == s.drafted


# ----------------------------------------------------------------- DFlash
@pytest.fixture(scope="module")
def dflash_random(heads_dir) -> Path:
    return write_dflash(heads_dir / "dflash-random.gguf", 11)


@pytest.fixture(scope="module")
def dflash_agree(heads_dir) -> Path:
    return write_dflash(heads_dir / "dflash-agree.gguf", 3, agree_with=7)


def test_dflash_head_is_detected_from_the_file(dflash_agree, dflash_random):
    from localspec.llama.heads import HEAD_ARCHS, file_arch

    assert HEAD_ARCHS[file_arch(dflash_agree)] == "dflash" and file_arch(dflash_random) == "dflash"


@pytest.mark.parametrize("exactness", ["lossless", "auto"])
def test_dflash_random_head_output_identical_to_plain(random4, dflash_random, exactness):
    from localspec.core.engine import Engine, GenConfig

    e = Engine.load(random4, dflash_random, n_ctx=512)
    try:
        assert list(e.heads) == ["dflash"]
        for prompt in PROMPTS:
            r = e.complete(e.raw_prompt(prompt), GenConfig(method="dflash", max_tokens=N, k=4, p_min=0.0,
                                                            exactness=exactness))
            assert r.tokens == _plain(random4, prompt), prompt
            assert r.stats.method == "dflash" and r.stats.drafted > 0
    finally:
        e.close()


def test_dflash_agreeing_head_accepts_and_rolls_back(bigram, dflash_agree):
    """The hand-built head names the token after the pending one from every mask row: with k=1 every draft is
    accepted (the injection, the block decode and the cache cleanup line up); with k=4 the first token of each
    block is accepted and the rest rejected (rollbacks, then injection over the rejected positions)."""
    from localspec.core.engine import Engine, GenConfig

    e = Engine.load(bigram, dflash_agree, n_ctx=512)
    try:
        for prompt in PROMPTS:
            plain = _plain(bigram, prompt)
            r = e.complete(e.raw_prompt(prompt), GenConfig(method="dflash", max_tokens=N, k=1, p_min=0.0,
                                                            exactness="lossless"))
            assert r.tokens == plain, prompt
            assert r.stats.drafted > 0 and r.stats.accepted == r.stats.drafted
            r = e.complete(e.raw_prompt(prompt), GenConfig(method="dflash", max_tokens=N, k=4, p_min=0.0,
                                                            exactness="lossless"))
            assert r.tokens == plain, prompt
            assert r.stats.accepted > 0 and r.stats.drafted > r.stats.accepted
        assert e.heads["dflash"].hook_calls > 0
    finally:
        e.close()


def test_dflash_block_size_caps_k(heads_dir, bigram):
    from localspec.core.engine import Engine, GenConfig

    path = write_dflash(heads_dir / "dflash-b3.gguf", 3, agree_with=7, block_size=3)
    e = Engine.load(bigram, path, n_ctx=512)
    try:
        r = e.complete(e.raw_prompt(PROMPTS[0]), GenConfig(method="dflash", max_tokens=N, k=6, p_min=0.0,
                                                            exactness="lossless"))
        assert r.tokens == _plain(bigram, PROMPTS[0])
        assert 0 < r.stats.drafted <= 2 * r.stats.drafting_steps  # block_size 3: [pending, mask, mask]
    finally:
        e.close()


def test_dflash_in_auto_long_prompt_and_sampling(bigram, dflash_agree):
    from localspec.drafters.dflash import DFlashDrafter

    check_block_head_in_auto_and_long_prompts(bigram, dflash_agree, DFlashDrafter, 3)


def test_dflash_flags_leave_target_logits_bit_identical(random4, dflash_random):
    import numpy as np

    from localspec.drafters.dflash import DFlashDrafter
    from localspec.llama.model import Model

    with Model(random4, n_ctx=512) as t:
        p = t.tokenize(PROMPTS[1])
        before = [t.decode(p, "all"), t.decode([5, 6, 7, 8], "all")]
        t.clear()
        d = DFlashDrafter.load(t, dflash_random)
        try:
            after = [t.decode(p, "all"), t.decode([5, 6, 7, 8], "all")]
        finally:
            d.close()
    for a, b in zip(before, after):
        assert np.array_equal(a, b)


def test_dflash_unsupported_target_arch_is_one_error_line(heads_dir, dflash_agree):
    q2 = write_bigram_target(heads_dir / "qwen2-dflash.gguf", 7, arch="qwen2")
    r = subprocess.run([sys.executable, "-m", "localspec", "run", "-m", str(q2), "-d", str(dflash_agree),
                        "--method", "dflash", "-n", "4", "--raw", "the cat"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "qwen2" in lines[0], r.stderr
    assert "DFlash" in lines[0] and "Traceback" not in r.stderr


def test_dflash_without_a_mask_token_is_refused(heads_dir, bigram):
    from localspec.core.engine import Engine
    from localspec.errors import IncompatibleDraftError

    path = write_dflash(heads_dir / "dflash-nomask.gguf", 3, mask_token=None)
    with pytest.raises(IncompatibleDraftError, match="mask token"):
        Engine.load(bigram, path, n_ctx=512)


def test_dflash_missing_symbol_makes_it_unavailable(monkeypatch, bigram, dflash_agree):
    from localspec.core.engine import Engine
    from localspec.errors import IncompatibleDraftError
    from localspec.llama import ext

    monkeypatch.setattr(ext, "_missing", ["llama_model_dflash_selector_top_k"])
    assert "llama_model_dflash_selector_top_k" in ext.heads_available()["dflash"]
    with pytest.raises(IncompatibleDraftError, match="--method dflash is unavailable"):
        Engine.load(bigram, dflash_agree, n_ctx=512)
    e = Engine.load(bigram, dflash_agree, n_ctx=512, drop_incompatible_draft=True)
    try:
        assert "unavailable" in e.dropped_draft and not e.heads
    finally:
        e.close()


# ----------------------------------------------------------------- stored tune results and an explicit draft
def test_a_tune_result_without_a_draft_never_drops_an_explicit_head(tmp_path, monkeypatch, bigram, agreeing_head):
    """`tune -m bigram.gguf` (no draft: it measures prompt lookup and plain decoding) then `run -m bigram.gguf -d
    eagle3.gguf`: the stored method must not replace the head the user named, in the CLI and in the settings the
    server resolves."""
    from localspec.session import Session

    env = {**os.environ, "LOCALSPEC_CONFIG_DIR": str(tmp_path / "cfg"), "LOCALSPEC_CACHE_DIR": str(tmp_path / "cache"),
           "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "localspec", "tune", "-m", str(bigram), "--k", "1,2", "-n", "8",
                        "--limit", "1"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "localspec", "run", "-m", str(bigram), "-d", str(agreeing_head),
                        "-n", "8", "--json", "--raw", "the cat"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["requested_method"] == "auto" and d["draft_dropped"] is None, d
    monkeypatch.setenv("LOCALSPEC_CONFIG_DIR", str(tmp_path / "cfg"))
    sess = Session({"model": str(bigram), "draft": str(agreeing_head), "ctx_size": 512}, quiet=True)
    try:
        s = sess.settings()
        assert s["method"].value == "auto" and s["method"].source == "default"
        assert "eagle3" in sess.load().heads  # the head is loaded, so `localspec.method: eagle3` has one to use
    finally:
        sess.close()
    s = Session({"model": str(bigram)}).settings()  # without a draft, the tune result applies
    assert s["method"].source.startswith("tune")


# ----------------------------------------------------------------- a draft head is never the target
@pytest.fixture(scope="module")
def head_only_files(heads_dir, agreeing_head) -> dict:
    return {"eagle3": agreeing_head, "dflash": write_dflash(heads_dir / "dflash-as-target.gguf", 3, agree_with=7),
            "mtp-only": write_glm4moe_mtp(heads_dir / "mtp-only.gguf", 7, n_trunk=0)}


@pytest.mark.parametrize("which,words", [("eagle3", "an EAGLE-3 draft head"), ("dflash", "a DFlash draft head"),
                                         ("mtp-only", "a file of MTP layers only")])
@pytest.mark.parametrize("cmd", [["run", "-n", "4", "--raw", "hi"], ["chat"], ["serve", "--port", "0"],
                                 ["bench", "--limit", "1", "-n", "4", "--categories", "chat"],
                                 ["tune", "--limit", "1", "-n", "4", "--k", "1"]])
def test_a_draft_head_as_the_target_is_one_error_line(tmp_path, head_only_files, which, words, cmd):
    """`run -m dflash-head.gguf` generated garbage (exit 0); an EAGLE-3 head failed only when llama.cpp could not
    make it a context. Every front end refuses a head file as the target, before loading anything."""
    f = head_only_files[which]
    env = {**os.environ, "LOCALSPEC_CONFIG_DIR": str(tmp_path / "cfg"), "LOCALSPEC_CACHE_DIR": str(tmp_path / "cache"),
           "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "localspec", cmd[0], "-m", str(f), *cmd[1:]], capture_output=True,
                       text=True, env=env, timeout=120, stdin=subprocess.DEVNULL)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: {f.name} is {words}") and "-m" in lines[0], lines[0]
    assert r.stdout == ""


def test_a_pair_whose_target_is_a_head_is_refused_at_load(tmp_path, monkeypatch, head_only_files):
    """The refusal holds for a target named by a pair (resolved to its file at load), in the session every front end
    (run, chat, serve, bench) loads through."""
    from localspec.errors import UsageError
    from localspec.models import registry
    from localspec.models.spec import FileSpec
    from localspec.session import Session

    monkeypatch.setenv("LOCALSPEC_CONFIG_DIR", str(tmp_path / "cfg"))
    registry.add("head-as-target", FileSpec(path=str(head_only_files["dflash"])), None, k=3, ctx=512)
    sess = Session({"model": "head-as-target"}, quiet=True)
    with pytest.raises(UsageError, match="a DFlash draft head"):
        sess.load()
    assert sess.engine is None


def test_a_method_without_its_head_names_the_head_with_its_article(tmp_path, bigram):
    """The message read "--method dflash needs an dflash draft head"."""
    env = {**os.environ, "LOCALSPEC_CONFIG_DIR": str(tmp_path / "cfg"), "HF_HUB_OFFLINE": "1"}
    for method, words in (("dflash", "a DFlash draft head"), ("eagle3", "an EAGLE-3 draft head")):
        r = subprocess.run([sys.executable, "-m", "localspec", "run", "-m", str(bigram), "--method", method, "-n", "2",
                            "--raw", "hi"], capture_output=True, text=True, env=env, timeout=120)
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert lines[0] == f"error: --method {method} needs {words} (-d PATH or a pair with a draft)", lines[0]


# ----------------------------------------------------------------- a head made for another target width
@pytest.fixture(scope="module")
def wide_bigram(heads_dir) -> Path:
    """The bigram target 128 wide: the fabricated heads are made for 64-wide targets."""
    return write_bigram_target(heads_dir / "bigram-128.gguf", 7, n_embd=128)


def test_an_eagle3_head_for_another_target_width_is_refused_and_auto_falls_back(heads_dir, wide_bigram):
    from localspec.drafters.eagle3 import Eagle3Drafter

    check_head_width_mismatch(wide_bigram, write_eagle3(heads_dir / "eagle3-64.gguf", 11), Eagle3Drafter, "eagle3")


def test_a_dflash_head_for_another_target_width_is_refused_and_auto_falls_back(heads_dir, wide_bigram):
    from localspec.drafters.dflash import DFlashDrafter

    check_head_width_mismatch(wide_bigram, write_dflash(heads_dir / "dflash-64.gguf", 11), DFlashDrafter, "dflash")


def test_a_head_of_the_other_kind_is_named_without_a_wrong_article(bigram, agreeing_head, heads_dir):
    from localspec.drafters.dflash import DFlashDrafter
    from localspec.drafters.eagle3 import Eagle3Drafter
    from localspec.errors import IncompatibleDraftError
    from localspec.llama.model import Model

    dflash = write_dflash(heads_dir / "dflash-other-kind.gguf", 3, agree_with=7)
    with Model(bigram, n_ctx=256) as t:
        with pytest.raises(IncompatibleDraftError) as e:
            DFlashDrafter.load(t, agreeing_head)
        assert str(e.value) == f"{agreeing_head.name} is not a DFlash head (its architecture is eagle3)"
        with pytest.raises(IncompatibleDraftError) as e:
            Eagle3Drafter.load(t, dflash)
        assert str(e.value) == f"{dflash.name} is not an EAGLE-3 head (its architecture is dflash)"
