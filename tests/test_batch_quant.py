"""The batch exactness probe (core/batch.py) against the truth on quantized weights: ggml-cpu repacks Q4_0/Q4_K
weights (8x8 layouts on AVX2/AVX-512) and runs a GEMM over 4-row groups of a pass and a GEMV on the rest; where
the two round differently, a row's logits depend on the rows in its pass. The test decodes the pass shapes a
batch makes directly and the probe must agree, whichever way it comes out on this CPU."""

from pathlib import Path

import numpy as np
import pytest

from conftest import REAL_MODELS
from localspec.core.batch import BatchEngine
from localspec.core.engine import Engine
from localspec.llama.multiseq import MultiSeq

SLOTS = 4


def write_q4_0(path: Path, seed: int, n_embd=256, n_layer=2, n_head=4, n_ff=512) -> Path:
    """tinymodels.write_model's llama, its matrices in Q4_0 (rows a multiple of 8, 32-wide blocks: repacked)."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    from tinymodels import CHATML, WORDS, llama_kv, vocab, vocab_kv

    tokens, scores, types = vocab(WORDS)
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def w(*shape):
        return quantize((rng.standard_normal(shape) * 0.6 / np.sqrt(shape[-1])).astype(np.float32), Q.Q4_0)

    wr = gguf.GGUFWriter(str(path), "llama")
    llama_kv(wr, f"tiny-q4_0-{seed}", 2048, n_embd, n_layer, n_ff, n_head, 2)  # file type: mostly Q4_0
    vocab_kv(wr, tokens, scores, types, CHATML)
    emb = rng.standard_normal((n_vocab, n_embd)).astype(np.float32)
    wr.add_tensor("token_embd.weight", emb.astype(np.float16))
    for i in range(n_layer):
        p = f"blk.{i}."
        wr.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for name, shape in (("attn_q", (n_embd, n_embd)), ("attn_k", (n_embd, n_embd)), ("attn_v", (n_embd, n_embd)),
                            ("attn_output", (n_embd, n_embd)), ("ffn_gate", (n_ff, n_embd)),
                            ("ffn_up", (n_ff, n_embd)), ("ffn_down", (n_embd, n_ff))):
            wr.add_tensor(p + name + ".weight", w(*shape), raw_dtype=Q.Q4_0)
        wr.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
    wr.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    out = rng.standard_normal((n_vocab, n_embd)).astype(np.float32) * (4.0 / np.sqrt(n_embd))
    out += emb[rng.permutation(n_vocab)] * 0.5
    out[[0, 1, 2, 3, 4]] = 0.0
    wr.add_tensor("output.weight", quantize(out, Q.Q4_0), raw_dtype=Q.Q4_0)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def truth(model, shapes, ext, head):
    """Per (requests, rows each): whether every row of one such pass equals one-token decoding, decoded directly
    on a fresh multi-sequence context (every sequence holds `toks`, then r more tokens in one pass); plus, under
    'prompt', whether a prompt decoded beside SLOTS - 1 one-row steps gives the target's own prefill logits."""
    toks = ext[:head]
    ms = MultiSeq(model, SLOTS)
    try:
        refs = [np.array(ms.decode([(0, [t], [0])])[0][0]) for t in ext]
        got = {}
        for s, r in shapes:
            ms.clear()
            for j in range(s):
                for t in toks:
                    ms.decode([(j, [t], [])])
            outs = ms.decode([(j, ext[len(toks):len(toks) + r], range(r)) for j in range(s)])
            got[(s, r)] = all(np.array_equal(o[i], refs[len(toks) + i]) for o in outs for i in range(r))
        ms.clear()
        for j in range(1, SLOTS):
            for t in toks:
                ms.decode([(j, [t], [])])
        outs = ms.decode([(0, toks, [len(toks) - 1])] + [(j, ext[len(toks):][:1], [0]) for j in range(1, SLOTS)])
        model.clear()
        own = model.decode(toks, "last")[0]
        model.clear()
        got["prompt"] = np.array_equal(outs[0][0], own) and all(np.array_equal(o[0], refs[len(toks)]) for o in outs[1:])
    finally:
        ms.close()
    return got


def check_probe_agrees(engine):
    b = BatchEngine(engine, SLOTS)
    try:
        exact, why = b.probe()
        res = b.probe_result()
        rows = b.bit_rows()
        text = engine.target.tokenize("Hello world, the x = y + 1, def f(x): return x and the cat", add_special=False)
        shapes = [(SLOTS, 1), (SLOTS, rows), (2, 2), (2, 1)]
        real = truth(engine.target, shapes, text[:6 + rows], 6)  # other tokens than the probe's own
        if not res.shapes:  # a verdict for every pass (a row beside a longer cache differs): it claims no shape
            assert not exact and not any(b.shape_exact(*shape) for shape in shapes), why
            return exact, real
        for shape in shapes:
            assert res.shapes[shape] == real[shape], (shape, why)
        assert res.beside_prompt[SLOTS] == real["prompt"], why
        if not all(real.values()):
            assert not exact, why  # a probe never says bit where a shape the batch makes is not
        return exact, real
    finally:
        b.close()


def test_the_probe_agrees_with_the_truth_on_repacked_q4_0_weights(tmp_path):
    e = Engine.load(write_q4_0(tmp_path / "q4_0.gguf", 3), n_ctx=512)
    try:
        check_probe_agrees(e)
    finally:
        e.close()


def test_the_probe_agrees_with_the_truth_on_a_real_q4_k_model():
    p = REAL_MODELS / "qwen2.5-coder-0.5b-instruct.gguf"
    if not p.exists():
        pytest.skip(f"no {p}")
    e = Engine.load(p, n_ctx=256, threads=2)
    try:
        check_probe_agrees(e)
    finally:
        e.close()
