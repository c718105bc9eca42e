"""Fabricate tiny targets with draft heads (EAGLE-3 drafts, MTP layers) for the draft-head tests.

Two kinds of target:
- random: tinymodels.write_model with 4 layers (a head on it is random too: mostly rejections);
- bigram: every block adds nothing (attn_output and ffn_down are zero), so the residual stream at every layer is the
  token's embedding and the next token is pi(t) for a fixed permutation pi of the word tokens (output row pi(t) is
  emb[t]). A head "agrees" with it when its own output maps a hidden state emb[t] to pi(pi(t)): the EAGLE-3 head
  sees g_P = emb[t_P] and must name t_{P+2}; the MTP layer sees h_P = emb[t_P] with token t_{P+1}.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tinymodels import CHATML, vocab, vocab_kv

N_SPECIAL = 5  # <unk> <s> </s> <|im_start|> <|im_end|>: never generated
PROMPTS = ["the cat and the dog", "def f(x): return x", "Once upon a time"]  # the head tests' prompts
N = 40  # ... and answer length


def plain_tokens(path, prompt, n=N):
    """The target's own greedy answer (one token a step, nothing drafted)."""
    from localspec.core.engine import Engine, GenConfig

    e = Engine.load(path, n_ctx=512)
    try:
        return e.complete(e.raw_prompt(prompt), GenConfig(method="none", max_tokens=n)).tokens
    finally:
        e.close()


def check_block_head_in_auto_and_long_prompts(bigram, head_path, drafter_cls, k: int) -> None:
    """A DFlash-kind head (`--method dflash`): auto offers it and keeps plain decoding's text; a prompt longer than
    n_batch (the hook sees only the last chunk's hidden states) keeps it too, with drafts accepted; sampling drafts."""
    from dataclasses import replace

    from localspec.core.engine import Engine, GenConfig
    from localspec.llama.model import Model
    from localspec.sample.sampling import SamplingParams

    e = Engine.load(bigram, head_path, n_ctx=512)
    try:
        cfg = GenConfig(method="auto", max_tokens=N, k=k, exactness="lossless")
        assert "dflash" in e.drafters_for(cfg, "auto")
        assert e.complete(e.raw_prompt(PROMPTS[2]), cfg).tokens == plain_tokens(bigram, PROMPTS[2])
    finally:
        e.close()
    t = Model(bigram, n_ctx=512, n_batch=16)
    e = Engine(t)
    e.heads["dflash"] = drafter_cls.load(t, head_path)
    try:
        text = " ".join(PROMPTS * 3)
        prompt = e.raw_prompt(text)
        assert len(prompt) > 16
        cfg = GenConfig(method="dflash", max_tokens=N, k=k, p_min=0.0, exactness="lossless")
        r = e.complete(prompt, cfg)
        assert r.tokens == plain_tokens(bigram, text) and r.stats.accepted > 0
        r = e.complete(prompt, replace(cfg, sampling=SamplingParams(temperature=0.8, seed=5)))
        assert len(r.tokens) == N and r.stats.drafted > 0
    finally:
        e.close()


def check_head_width_mismatch(target: Path, head: Path, drafter_cls, method: str) -> None:
    """A head made for a target of another width: its drafter refuses it at load, naming both widths, before any
    flag is set on the target; under auto the engine leaves it out and decodes as plain decoding; an explicit
    method is one error line (exit 1) and auto falls back (exit 0), from the command line."""
    import os
    import subprocess
    import sys

    import pytest

    from localspec.core.engine import Engine, GenConfig
    from localspec.errors import IncompatibleDraftError
    from localspec.llama.model import Model

    why = f"{head.name} was trained on a target of hidden size 64, {target.name} has 128"
    with Model(target, n_ctx=256) as t:
        with pytest.raises(IncompatibleDraftError) as e:
            drafter_cls.load(t, head)
        assert str(e.value) == why
        t.decode([1, 5, 6])  # no flag was set: the target still decodes
    with pytest.raises(IncompatibleDraftError, match="hidden size 64"):
        Engine.load(target, head, n_ctx=512)
    e = Engine.load(target, head, n_ctx=512, drop_incompatible_draft=True)
    try:
        assert e.dropped_draft == why and not e.heads
        out = e.complete(e.raw_prompt(PROMPTS[0]), GenConfig(method="auto", max_tokens=N)).tokens
    finally:
        e.close()
    assert out == plain_tokens(target, PROMPTS[0])
    env = {**os.environ, "LOCALSPEC_CONFIG_DIR": str(head.parent / "cfg"), "HF_HUB_OFFLINE": "1"}
    for args, rc in ((["--method", method], 1), ([], 0)):
        r = subprocess.run([sys.executable, "-m", "localspec", "run", "-m", str(target), "-d", str(head), *args,
                            "-n", "4", "--raw", "the cat"], capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL, env=env)
        assert r.returncode == rc, r.stderr
        assert "hidden size 64" in r.stderr and "Traceback" not in r.stderr and "batch" not in r.stderr, r.stderr
        if rc:
            lines = [x for x in r.stderr.splitlines() if x.strip()]
            assert len(lines) == 1 and lines[0] == f"error: {why}", r.stderr
        else:
            assert r.stdout.strip(), r.stderr


def _finish(wr):
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


def bigram_parts(seed: int, n_embd: int = 64):
    """(tokens, scores, types, emb, pi): the bigram target's vocabulary, embeddings and successor permutation."""
    tokens, scores, types = vocab()
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((n_vocab, n_embd)).astype(np.float32)
    words = np.arange(N_SPECIAL, n_vocab)
    pi = np.arange(n_vocab)
    pi[words] = rng.permutation(words)  # successor of word token t
    return tokens, scores, types, emb, pi


def _out_for(emb, succ, n_vocab):
    """An output matrix whose argmax on hidden state emb[t] is succ[t] (for word tokens t)."""
    out = np.zeros((n_vocab, emb.shape[1]), dtype=np.float32)
    for t in range(N_SPECIAL, n_vocab):
        out[succ[t]] = emb[t] * (4.0 / np.sqrt(emb.shape[1]))
    return out


def write_bigram_target(path: Path, seed: int, *, n_embd=64, n_layer=4, n_head=4, n_ff=128, arch="llama") -> Path:
    """The bigram target (see the module docstring); arch "qwen2" gives the same weights under an arch whose graph
    does not extract layer inputs."""
    import gguf

    tokens, scores, types, emb, pi = bigram_parts(seed, n_embd)
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed + 1)
    head_dim = n_embd // n_head

    def w(*shape):
        return (rng.standard_normal(shape) * 0.6 / np.sqrt(shape[-1])).astype(np.float16)

    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_name(f"bigram-{seed}")
    wr.add_context_length(2048)
    wr.add_embedding_length(n_embd)
    wr.add_block_count(n_layer)
    wr.add_feed_forward_length(n_ff)
    wr.add_head_count(n_head)
    wr.add_head_count_kv(n_head)
    wr.add_rope_dimension_count(head_dim)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_file_type(1)
    vocab_kv(wr, tokens, scores, types)
    wr.add_tensor("token_embd.weight", emb.astype(np.float16))
    zero = np.zeros((n_embd, n_embd), dtype=np.float16)
    for i in range(n_layer):
        p = f"blk.{i}."
        wr.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        wr.add_tensor(p + "attn_q.weight", w(n_embd, n_embd))
        wr.add_tensor(p + "attn_k.weight", w(n_embd, n_embd))
        wr.add_tensor(p + "attn_v.weight", w(n_embd, n_embd))
        wr.add_tensor(p + "attn_output.weight", zero)
        wr.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        wr.add_tensor(p + "ffn_gate.weight", w(n_ff, n_embd))
        wr.add_tensor(p + "ffn_up.weight", w(n_ff, n_embd))
        wr.add_tensor(p + "ffn_down.weight", np.zeros((n_embd, n_ff), dtype=np.float16))
    wr.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    wr.add_tensor("output.weight", _out_for(emb, pi, n_vocab).astype(np.float16))
    _finish(wr)
    return path


def write_eagle3(path: Path, seed: int, *, agree_with: int | None = None, layers=(0, 1, 3), n_embd=64, n_embd_tgt=64,
                 n_head=4, n_ff=128, reduced_vocab: bool = True) -> Path:
    """An `eagle3` draft GGUF for a 4-layer target with n_embd_tgt. Random weights, or (agree_with=SEED of the bigram
    target) a head whose own output names t_{P+2} from g_P = emb[t_P]: fc copies the first extracted layer, the
    block adds nothing. reduced_vocab: a `d2t` map over the word tokens only (the draft vocabulary is smaller)."""
    import gguf

    tokens, scores, types = vocab()
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head

    def w(*shape, std=0.6):
        return (rng.standard_normal(shape) * std / np.sqrt(shape[-1])).astype(np.float16)

    wr = gguf.GGUFWriter(str(path), "eagle3")
    wr.add_name(f"eagle3-{seed}")
    wr.add_context_length(2048)
    wr.add_embedding_length(n_embd)
    wr.add_block_count(1)
    wr.add_feed_forward_length(n_ff)
    wr.add_head_count(n_head)
    wr.add_head_count_kv(n_head)
    wr.add_rope_dimension_count(head_dim)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_file_type(1)
    wr.add_array("eagle3.target_layers", [int(x) for x in layers])
    wr.add_uint32("eagle3.target_hidden_size", n_embd_tgt)
    vocab_kv(wr, tokens, scores, types)
    d2t = np.arange(N_SPECIAL, n_vocab, dtype=np.int64) if reduced_vocab else np.arange(n_vocab, dtype=np.int64)
    if agree_with is not None:
        _, _, _, emb, pi = bigram_parts(agree_with, n_embd_tgt)
        assert n_embd == n_embd_tgt
        fc = np.zeros((n_embd, 3 * n_embd_tgt), dtype=np.float16)
        fc[:, :n_embd_tgt] = np.eye(n_embd, dtype=np.float16)
        wo = np.zeros((n_embd, n_embd), dtype=np.float16)
        down = np.zeros((n_embd, n_ff), dtype=np.float16)
        out_full = _out_for(emb, pi[pi], n_vocab)  # emb[t] -> pi(pi(t))
        out = out_full[d2t]
    else:
        fc = w(n_embd, 3 * n_embd_tgt)
        wo = w(n_embd, n_embd)
        down = w(n_embd, n_ff)
        out = rng.standard_normal((len(d2t), n_embd)).astype(np.float32) * (4.0 / np.sqrt(n_embd))
    wr.add_tensor("fc.weight", fc)
    p = "blk.0."
    wr.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
    wr.add_tensor(p + "attn_norm_2.weight", np.ones(n_embd, dtype=np.float32))
    wr.add_tensor(p + "attn_q.weight", w(n_embd, 2 * n_embd))
    wr.add_tensor(p + "attn_k.weight", w(n_embd, 2 * n_embd))
    wr.add_tensor(p + "attn_v.weight", w(n_embd, 2 * n_embd))
    wr.add_tensor(p + "attn_output.weight", wo)
    wr.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
    wr.add_tensor(p + "ffn_gate.weight", w(n_ff, n_embd))
    wr.add_tensor(p + "ffn_up.weight", w(n_ff, n_embd))
    wr.add_tensor(p + "ffn_down.weight", down)
    wr.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    wr.add_tensor("output.weight", out.astype(np.float16))
    wr.add_tensor("d2t", d2t)
    _finish(wr)
    return path


def write_glm4moe_mtp(path: Path, seed: int, *, mtp: str = "agree", wrong: float = 0.3, n_embd=64, n_head=4,
                      n_ff=128, n_expert=4, n_expert_used=2, n_ff_exp=32, n_trunk=2, n_mtp=1) -> Path:
    """A `glm4moe` target whose last block is one MTP (nextn) layer, MoE like the trunk's layer 1 (layer 0 is dense).
    The trunk is the bigram target of `seed` (blocks add nothing, next token pi(t)). mtp="agree": the MTP layer
    names pi(t_{P+1}) from the token it is given (eh_proj keeps the token half, the block adds nothing), through its
    own shared head, which is wrong for a `wrong` fraction of the tokens (so rollbacks happen); mtp="random": random
    weights (mostly rejections). n_mtp > 1: that many MTP layers (llama.cpp's glm4moe MTP graph runs one only)."""
    import gguf

    tokens, scores, types, emb, pi = bigram_parts(seed, n_embd)
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed + 2)
    head_dim = n_embd // n_head
    n_all = n_trunk + n_mtp

    def w(*shape, std=0.6):
        return (rng.standard_normal(shape) * std / np.sqrt(shape[-1])).astype(np.float16)

    def z(*shape):
        return np.zeros(shape, dtype=np.float16)

    ones = np.ones(n_embd, dtype=np.float32)
    wr = gguf.GGUFWriter(str(path), "glm4moe")
    wr.add_name(f"glm4moe-mtp-{seed}")
    wr.add_context_length(2048)
    wr.add_embedding_length(n_embd)
    wr.add_block_count(n_all)
    wr.add_feed_forward_length(n_ff)
    wr.add_expert_feed_forward_length(n_ff_exp)
    wr.add_head_count(n_head)
    wr.add_head_count_kv(n_head)
    wr.add_rope_dimension_count(head_dim)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_expert_count(n_expert)
    wr.add_expert_used_count(n_expert_used)
    wr.add_expert_shared_count(1)
    wr.add_leading_dense_block_count(1)
    wr.add_expert_weights_norm(True)
    wr.add_expert_weights_scale(1.0)
    wr.add_uint32("glm4moe.nextn_predict_layers", n_mtp)
    wr.add_file_type(1)
    vocab_kv(wr, tokens, scores, types)
    wr.add_tensor("token_embd.weight", emb.astype(np.float16))
    for i in range(n_all):
        p = f"blk.{i}."
        is_mtp = i >= n_trunk
        rand = is_mtp and mtp == "random"
        wr.add_tensor(p + "attn_norm.weight", ones)
        wr.add_tensor(p + "attn_q.weight", w(n_embd, n_embd))
        wr.add_tensor(p + "attn_k.weight", w(n_embd, n_embd))
        wr.add_tensor(p + "attn_v.weight", w(n_embd, n_embd))
        wr.add_tensor(p + "attn_output.weight", w(n_embd, n_embd) if rand else z(n_embd, n_embd))
        wr.add_tensor(p + "post_attention_norm.weight", ones)
        if i == 0:  # dense
            wr.add_tensor(p + "ffn_gate.weight", w(n_ff, n_embd))
            wr.add_tensor(p + "ffn_up.weight", w(n_ff, n_embd))
            wr.add_tensor(p + "ffn_down.weight", z(n_embd, n_ff))
        else:  # MoE (the MTP layer must be: its graph has no dense branch)
            wr.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((n_expert, n_embd)).astype(np.float32))
            wr.add_tensor(p + "exp_probs_b.bias", np.zeros(n_expert, dtype=np.float32))
            wr.add_tensor(p + "ffn_gate_exps.weight", w(n_expert, n_ff_exp, n_embd))
            wr.add_tensor(p + "ffn_up_exps.weight", w(n_expert, n_ff_exp, n_embd))
            wr.add_tensor(p + "ffn_down_exps.weight", w(n_expert, n_embd, n_ff_exp) if rand
                          else z(n_expert, n_embd, n_ff_exp))
            wr.add_tensor(p + "ffn_gate_shexp.weight", w(n_ff_exp, n_embd))
            wr.add_tensor(p + "ffn_up_shexp.weight", w(n_ff_exp, n_embd))
            wr.add_tensor(p + "ffn_down_shexp.weight", w(n_embd, n_ff_exp) if rand else z(n_embd, n_ff_exp))
        if is_mtp:
            if rand:
                eh = w(n_embd, 2 * n_embd)
                head = rng.standard_normal((n_vocab, n_embd)).astype(np.float32) * (4.0 / np.sqrt(n_embd))
            else:
                eh = np.zeros((n_embd, 2 * n_embd), dtype=np.float16)
                eh[:, :n_embd] = np.eye(n_embd, dtype=np.float16)  # the token's half: emb[t_{P+1}]
                succ = pi.copy()
                words = np.arange(N_SPECIAL, n_vocab)
                bad = rng.choice(words, int(wrong * len(words)), replace=False)
                succ[bad] = pi[pi[bad]]  # wrong successors for these tokens
                head = _out_for(emb, succ, n_vocab)
            wr.add_tensor(p + "nextn.eh_proj.weight", eh)
            wr.add_tensor(p + "nextn.enorm.weight", ones)
            wr.add_tensor(p + "nextn.hnorm.weight", ones)
            wr.add_tensor(p + "nextn.shared_head_norm.weight", ones)
            wr.add_tensor(p + "nextn.shared_head_head.weight", head.astype(np.float16))
    wr.add_tensor("output_norm.weight", ones)
    wr.add_tensor("output.weight", _out_for(emb, pi, n_vocab).astype(np.float16))
    _finish(wr)
    return path


MASK_TOKEN = 0  # <unk>: never generated, the DFlash drafts' mask token


def write_dflash(path: Path, seed: int, *, agree_with: int | None = None, layers=(0, 1, 3), n_embd=64, n_embd_tgt=64,
                 n_head=4, n_ff=128, block_size=8, mask_token: int | None = MASK_TOKEN, extra=None) -> Path:
    """A `dflash` draft GGUF (src/models/dflash.cpp: fc + enc.output_norm over the target's layer inputs, injected
    as K/V; a token batch [pending, mask x n] attends non-causally to them and to itself) with its own embeddings
    and output head. Random weights, or (agree_with=SEED of the bigram target) a head whose every mask row names
    pi(pending): one head, rope on dims 0-1 only; dim 2 flags a word token, dim 3 the mask token, dims 4.. carry
    the token's identity r_t. A mask row's query (dim 2, scaled by attn_q_norm) meets only word tokens' keys, so it
    attends to the pending token alone (injected rows: fc = 0, K = V = 0; other masks: K = 0), copies its r_t (V,
    wo: identity on dims 4..) and the output row pi(t) is r_t. Only the first drafted token can be right: later ones
    are pi(pending) again, so rollbacks happen. mask_token None: the vocabulary declares none. extra(writer, n_vocab):
    more keys and tensors (a DSpark head's Markov head)."""
    import gguf

    tokens, scores, types = vocab()
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def w(*shape, std=0.6):
        return (rng.standard_normal(shape) * std / np.sqrt(shape[-1])).astype(np.float16)

    if agree_with is not None:
        n_head = 1
    head_dim = n_embd // n_head
    n_in = len(layers) * n_embd_tgt
    wr = gguf.GGUFWriter(str(path), "dflash")
    wr.add_name(f"dflash-{seed}")
    wr.add_context_length(2048)
    wr.add_embedding_length(n_embd)
    wr.add_block_count(1)
    wr.add_feed_forward_length(n_ff)
    wr.add_head_count(n_head)
    wr.add_head_count_kv(n_head)
    wr.add_rope_dimension_count(2 if agree_with is not None else head_dim)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_file_type(1)
    wr.add_array("dflash.target_layers", [int(x) for x in layers])
    wr.add_uint32("dflash.block_size", block_size)
    vocab_kv(wr, tokens, scores, types)
    if mask_token is not None:
        wr.add_uint32("tokenizer.ggml.mask_token_id", mask_token)
    ones = np.ones(n_embd, dtype=np.float32)
    p = "blk.0."
    if agree_with is not None:
        _, _, _, _, pi = bigram_parts(agree_with, n_embd_tgt)
        ident = slice(4, n_embd)
        r = rng.standard_normal((n_vocab, n_embd - 4)).astype(np.float32)
        emb = np.zeros((n_vocab, n_embd), dtype=np.float32)
        emb[:, ident] = r
        emb[:, 2] = 1.0
        emb[MASK_TOKEN] = 0.0
        emb[MASK_TOKEN, 3] = 1.0
        out = np.zeros((n_vocab, n_embd), dtype=np.float32)
        for t in range(N_SPECIAL, n_vocab):
            out[pi[t], ident] = r[t] * (4.0 / np.sqrt(n_embd))
        fc = np.zeros((n_embd, n_in), dtype=np.float16)
        wq = np.zeros((n_embd, n_embd), dtype=np.float16)
        wq[2, 3] = 1.0  # a mask row asks for word tokens
        wk = np.zeros((n_embd, n_embd), dtype=np.float16)
        wk[2, 2] = 1.0  # a word token answers
        wv = np.zeros((n_embd, n_embd), dtype=np.float16)
        wv[ident, ident] = np.eye(n_embd - 4, dtype=np.float16)
        wo = np.eye(n_embd, dtype=np.float16)
        qn = np.full(head_dim, 4.0, dtype=np.float32)
        kn = np.full(head_dim, 4.0, dtype=np.float32)
        down = np.zeros((n_embd, n_ff), dtype=np.float16)
    else:
        emb = rng.standard_normal((n_vocab, n_embd)).astype(np.float32)
        out = rng.standard_normal((n_vocab, n_embd)).astype(np.float32) * (4.0 / np.sqrt(n_embd))
        fc, wq, wk, wv, wo = w(n_embd, n_in), w(n_embd, n_embd), w(n_embd, n_embd), w(n_embd, n_embd), w(n_embd, n_embd)
        qn = kn = np.ones(head_dim, dtype=np.float32)
        down = w(n_embd, n_ff)
    wr.add_tensor("token_embd.weight", emb.astype(np.float16))
    wr.add_tensor("fc.weight", fc)
    wr.add_tensor("enc.output_norm.weight", ones)
    wr.add_tensor(p + "attn_norm.weight", ones)
    wr.add_tensor(p + "attn_q.weight", wq)
    wr.add_tensor(p + "attn_k.weight", wk)
    wr.add_tensor(p + "attn_v.weight", wv)
    wr.add_tensor(p + "attn_output.weight", wo)
    wr.add_tensor(p + "attn_q_norm.weight", qn)
    wr.add_tensor(p + "attn_k_norm.weight", kn)
    wr.add_tensor(p + "ffn_norm.weight", ones)
    wr.add_tensor(p + "ffn_gate.weight", w(n_ff, n_embd))
    wr.add_tensor(p + "ffn_up.weight", w(n_ff, n_embd))
    wr.add_tensor(p + "ffn_down.weight", down)
    wr.add_tensor("output_norm.weight", ones)
    wr.add_tensor("output.weight", out.astype(np.float16))
    if extra is not None:
        extra(wr, n_vocab)
    _finish(wr)
    return path


def write_dspark(path: Path, seed: int, *, agree_with: int | None = None, wrong: float = 0.0, rank: int = 128,
                 block_size: int = 8, sample_from_anchor: bool | None = True, conf: bool = False,
                 layers=(0, 1, 3)) -> Path:
    """A DSpark draft GGUF as llama.cpp's converter writes one (arch `dflash` plus `markov_w1`/`markov_w2`, optional
    `conf_proj`; src/models/dflash.cpp build_dspark_markov_head): a random DFlash backbone whose logits the Markov
    bias w2 . w1[prev] outweighs (its successor scores 100, the backbone's logits stay within about +-12), prev being
    the pending token for the first drafted position and the previous position's argmax after that.

    The Markov successor s(t) of a word token t is pi(t) of the bigram target agree_with (an agreeing head: with
    wrong=0 every chained draft is right), except for a `wrong` fraction of the words, whose successor is another
    word; without agree_with, s is a random permutation. w1 row t: dim 0 flags s(t) == pi(t) (+1, else -1), dims
    1.. a unit vector u_t; w2 row s(t) carries 100 * u_t (and 0 on dim 0). conf: a confidence head that reads only
    that flag, sigmoid(+-8), so a draft stops before each wrong successor where p_min > 0. sample_from_anchor None:
    the key is absent (llama.cpp then samples from the anchor); False: the bonus-anchor layout."""
    n_embd = 64
    tokens, _, _ = vocab()
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed + 100)
    words = np.arange(N_SPECIAL, n_vocab)
    if agree_with is not None:
        pi = bigram_parts(agree_with)[4]
    else:
        pi = np.arange(n_vocab)
        pi[words] = rng.permutation(words)
    succ = pi.copy()
    for t in rng.choice(words, size=int(round(wrong * len(words))), replace=False):
        succ[t] = rng.choice(words[(words != pi[t]) & (words != t)])
    u = rng.standard_normal((n_vocab, rank - 1))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    w1 = np.zeros((n_vocab, rank), dtype=np.float32)
    w2 = np.zeros((n_vocab, rank), dtype=np.float32)
    for t in words:
        w1[t, 0] = 1.0 if (agree_with is None or succ[t] == pi[t]) else -1.0
        w1[t, 1:] = u[t]
        w2[succ[t], 1:] += 100.0 * u[t]

    def markov(wr, n):
        assert n == n_vocab
        if sample_from_anchor is not None:
            wr.add_bool("dflash.sample_from_anchor", sample_from_anchor)
        wr.add_bool("dflash.has_confidence_head", conf)
        wr.add_tensor("markov_w1.weight", w1.astype(np.float16))
        wr.add_tensor("markov_w2.weight", w2.astype(np.float16))
        if conf:
            proj = np.zeros((1, n_embd + rank), dtype=np.float32)
            proj[0, n_embd] = 8.0  # the flag dimension of w1[prev]
            wr.add_tensor("conf_proj.weight", proj.astype(np.float16))
            wr.add_tensor("conf_proj.bias", np.zeros(1, dtype=np.float32))

    return write_dflash(path, seed, layers=layers, n_embd=n_embd, block_size=block_size, extra=markov)


def write_qwen35_mtp(path: Path, seed: int, *, mtp: str = "agree", wrong: float = 0.3, n_embd=64, n_head=4,
                     n_ff=128, n_trunk=4, d_state=16, n_group=2, n_v_heads=4, d_conv=4) -> Path:
    """A `qwen35` hybrid target (gated-delta-net layers 0 and 2, attention layers 1 and 3: recurrent state plus a KV
    cache) with one MTP layer after the trunk, as Qwen3.5 ships it. The trunk is the bigram target of `seed` (every
    block adds nothing: ssm_out, attn_output and ffn_down are zero; next token pi(t)); the MTP layer is as in
    write_glm4moe_mtp (mtp="agree": names pi(t_{P+1}), wrong for a `wrong` fraction; "random": random weights)."""
    import gguf

    tokens, scores, types, emb, pi = bigram_parts(seed, n_embd)
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed + 3)
    head_dim = n_embd // n_head
    key_dim, value_dim = d_state * n_group, d_state * n_v_heads
    conv_dim = 2 * key_dim + value_dim

    def w(*shape, std=0.6):
        return (rng.standard_normal(shape) * std / np.sqrt(shape[-1])).astype(np.float16)

    def z(*shape):
        return np.zeros(shape, dtype=np.float16)

    ones = np.ones(n_embd, dtype=np.float32)
    wr = gguf.GGUFWriter(str(path), "qwen35")
    wr.add_name(f"qwen35-mtp-{seed}")
    wr.add_context_length(2048)
    wr.add_embedding_length(n_embd)
    wr.add_block_count(n_trunk + 1)
    wr.add_feed_forward_length(n_ff)
    wr.add_head_count(n_head)
    wr.add_head_count_kv(n_head)
    wr.add_key_length(head_dim)
    wr.add_value_length(head_dim)
    wr.add_rope_dimension_count(head_dim)
    wr.add_array("qwen35.rope.dimension_sections", [head_dim // 4, head_dim // 8, head_dim // 8, 0])
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_uint32("qwen35.ssm.conv_kernel", d_conv)
    wr.add_uint32("qwen35.ssm.inner_size", value_dim)
    wr.add_uint32("qwen35.ssm.state_size", d_state)
    wr.add_uint32("qwen35.ssm.time_step_rank", n_v_heads)
    wr.add_uint32("qwen35.ssm.group_count", n_group)
    wr.add_uint32("qwen35.full_attention_interval", 2)
    wr.add_uint32("qwen35.nextn_predict_layers", 1)
    wr.add_file_type(1)
    vocab_kv(wr, tokens, scores, types)
    wr.add_tensor("token_embd.weight", emb.astype(np.float16))

    def attention(p, rand):
        wr.add_tensor(p + "attn_q.weight", w(2 * n_embd, n_embd))  # query and its gate
        wr.add_tensor(p + "attn_k.weight", w(n_embd, n_embd))
        wr.add_tensor(p + "attn_v.weight", w(n_embd, n_embd))
        wr.add_tensor(p + "attn_output.weight", w(n_embd, n_embd) if rand else z(n_embd, n_embd))
        wr.add_tensor(p + "attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
        wr.add_tensor(p + "attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))

    for i in range(n_trunk + 1):
        p = f"blk.{i}."
        is_mtp = i == n_trunk
        rand = is_mtp and mtp == "random"
        wr.add_tensor(p + "attn_norm.weight", ones)
        wr.add_tensor(p + "post_attention_norm.weight", ones)
        if is_mtp or (i + 1) % 2 == 0:
            attention(p, rand)
        else:  # gated delta net
            wr.add_tensor(p + "attn_qkv.weight", w(conv_dim, n_embd))
            wr.add_tensor(p + "attn_gate.weight", w(value_dim, n_embd))
            wr.add_tensor(p + "ssm_conv1d.weight", (rng.standard_normal((conv_dim, d_conv)) * 0.5).astype(np.float32))
            wr.add_tensor(p + "ssm_dt.bias", np.zeros(n_v_heads, dtype=np.float32))
            wr.add_tensor(p + "ssm_a", -np.ones(n_v_heads, dtype=np.float32))
            wr.add_tensor(p + "ssm_beta.weight", w(n_v_heads, n_embd))
            wr.add_tensor(p + "ssm_alpha.weight", w(n_v_heads, n_embd))
            wr.add_tensor(p + "ssm_norm.weight", np.ones(d_state, dtype=np.float32))
            wr.add_tensor(p + "ssm_out.weight", z(n_embd, value_dim))
        wr.add_tensor(p + "ffn_gate.weight", w(n_ff, n_embd))
        wr.add_tensor(p + "ffn_up.weight", w(n_ff, n_embd))
        wr.add_tensor(p + "ffn_down.weight", w(n_embd, n_ff) if rand else z(n_embd, n_ff))
        if is_mtp:
            if rand:
                eh = w(n_embd, 2 * n_embd)
                head = rng.standard_normal((n_vocab, n_embd)).astype(np.float32) * (4.0 / np.sqrt(n_embd))
            else:
                eh = np.zeros((n_embd, 2 * n_embd), dtype=np.float16)
                eh[:, :n_embd] = np.eye(n_embd, dtype=np.float16)  # the token's half: emb[t_{P+1}]
                succ = pi.copy()
                words = np.arange(N_SPECIAL, n_vocab)
                bad = rng.choice(words, int(wrong * len(words)), replace=False)
                succ[bad] = pi[pi[bad]]
                head = _out_for(emb, succ, n_vocab)
            wr.add_tensor(p + "nextn.eh_proj.weight", eh)
            wr.add_tensor(p + "nextn.enorm.weight", ones)
            wr.add_tensor(p + "nextn.hnorm.weight", ones)
            wr.add_tensor(p + "nextn.shared_head_norm.weight", ones)
            wr.add_tensor(p + "nextn.shared_head_head.weight", head.astype(np.float16))
    wr.add_tensor("output_norm.weight", ones)
    wr.add_tensor("output.weight", _out_for(emb, pi, n_vocab).astype(np.float16))
    _finish(wr)
    return path


def write_mimo2_mtp(path: Path, seed: int, *, mtp=("agree", "agree"), n_embd=64, n_head=4, n_ff=128, n_trunk=2
                    ) -> Path:
    """A dense `mimo2` target with len(mtp) MTP (nextn) layers after the trunk: an arch whose llama.cpp MTP graph
    takes any of its layers (llama_set_nextn_layer_offset), so the heads chain (head i drafts token i). The trunk
    is the bigram target of `seed`; each MTP layer is "agree" (names pi(t) from the token t it is given, always
    right) or "random"."""
    import gguf

    tokens, scores, types, emb, pi = bigram_parts(seed, n_embd)
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed + 4)
    head_dim = n_embd // n_head
    n_all = n_trunk + len(mtp)

    def w(*shape, std=0.6):
        return (rng.standard_normal(shape) * std / np.sqrt(shape[-1])).astype(np.float16)

    def z(*shape):
        return np.zeros(shape, dtype=np.float16)

    ones = np.ones(n_embd, dtype=np.float32)
    wr = gguf.GGUFWriter(str(path), "mimo2")
    wr.add_name(f"mimo2-mtp-{seed}")
    wr.add_context_length(2048)
    wr.add_embedding_length(n_embd)
    wr.add_block_count(n_all)
    wr.add_feed_forward_length(n_ff)
    wr.add_uint32("mimo2.expert_feed_forward_length", n_ff)
    wr.add_head_count(n_head)
    wr.add_head_count_kv(n_head)
    wr.add_rope_dimension_count(head_dim)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_uint32("mimo2.attention.sliding_window", 4096)
    wr.add_array("mimo2.attention.sliding_window_pattern", [True] + [False] * (n_all - 1))  # one is required
    wr.add_uint32("mimo2.nextn_predict_layers", len(mtp))
    wr.add_file_type(1)
    vocab_kv(wr, tokens, scores, types)
    wr.add_tensor("token_embd.weight", emb.astype(np.float16))
    for i in range(n_all):
        p = f"blk.{i}."
        kind = mtp[i - n_trunk] if i >= n_trunk else "trunk"
        rand = kind == "random"
        wr.add_tensor(p + "attn_norm.weight", ones)
        wr.add_tensor(p + "attn_qkv.weight", w(3 * n_embd, n_embd))
        wr.add_tensor(p + "attn_output.weight", w(n_embd, n_embd) if rand else z(n_embd, n_embd))
        wr.add_tensor(p + "ffn_norm.weight", ones)
        wr.add_tensor(p + "ffn_gate.weight", w(n_ff, n_embd))
        wr.add_tensor(p + "ffn_up.weight", w(n_ff, n_embd))
        wr.add_tensor(p + "ffn_down.weight", w(n_embd, n_ff) if rand else z(n_embd, n_ff))
        if i >= n_trunk:
            if rand:
                eh = w(n_embd, 2 * n_embd)
                head = rng.standard_normal((n_vocab, n_embd)).astype(np.float32) * (4.0 / np.sqrt(n_embd))
            else:
                eh = np.zeros((n_embd, 2 * n_embd), dtype=np.float16)
                eh[:, :n_embd] = np.eye(n_embd, dtype=np.float16)  # the token's half
                head = _out_for(emb, pi, n_vocab)
            wr.add_tensor(p + "nextn.eh_proj.weight", eh)
            wr.add_tensor(p + "nextn.enorm.weight", ones)
            wr.add_tensor(p + "nextn.hnorm.weight", ones)
            wr.add_tensor(p + "nextn.shared_head_norm.weight", ones)
            wr.add_tensor(p + "nextn.shared_head_head.weight", head.astype(np.float16))
    wr.add_tensor("output_norm.weight", ones)
    wr.add_tensor("output.weight", _out_for(emb, pi, n_vocab).astype(np.float16))
    _finish(wr)
    return path
