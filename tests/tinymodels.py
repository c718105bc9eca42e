"""Fabricate tiny llama-architecture GGUF models with random weights (for fast, offline tests).

Vocab: SPM with <unk>, <s>, </s>, the chat markers, the 256 byte tokens and a few word pieces.
The weights are random; `pick_seed` searches seeds until plain greedy decoding keeps a wide top-2
logit margin over the test length, so batch-shape rounding can never flip an argmax.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A Qwen2.5-style template, cut down to what tools need (the real one prints the same markup).
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are helpful.{% endif %}

# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and tools %}{# printed above #}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for tc in message.tool_calls %}{% set tc = tc.function %}<tool_call>
{"name": "{{ tc.name }}", "arguments": {{ tc.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WORDS = ["▁the", "▁a", "▁and", "▁of", "▁to", "▁is", "▁in", "▁it", "▁def", "▁return", "▁x", "▁y", "▁=", "▁+",
         "(", ")", ":", "e", "t", "a", "o", "n", "s", "▁", "in", "er", "on", "at"]
OTHER_WORDS = ["▁le", "▁la", "▁et", "▁de", "▁un", "▁une", "▁est", "▁dans", "▁pour", "▁pas", "▁que", "▁qui",
               "▁sur", "▁avec", "[", "]", ";", "é", "è", "à", "u", "i", "r", "▁", "ou", "ai", "ch", "qu"]


def vocab(words=WORDS):
    tokens, scores, types = [], [], []

    def add(text, score, typ):
        tokens.append(text)
        scores.append(score)
        types.append(typ)

    add("<unk>", 0.0, 2)
    add("<s>", 0.0, 3)
    add("</s>", 0.0, 3)
    add("<|im_start|>", 0.0, 3)
    add("<|im_end|>", 0.0, 3)
    for b in range(256):
        add(f"<0x{b:02X}>", 0.0, 6)
    for i, w in enumerate(words):
        add(w, -1.0 - 0.01 * i, 1)
    return tokens, scores, types


def llama_kv(wr, name: str, n_ctx_train: int, n_embd: int, n_layer: int, n_ff: int, n_head: int,
             file_type: int) -> None:
    """The llama arch's hyperparameters of a tiny model (as many KV heads as heads)."""
    wr.add_name(name)
    wr.add_context_length(n_ctx_train)
    wr.add_embedding_length(n_embd)
    wr.add_block_count(n_layer)
    wr.add_feed_forward_length(n_ff)
    wr.add_head_count(n_head)
    wr.add_head_count_kv(n_head)
    wr.add_rope_dimension_count(n_embd // n_head)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_file_type(file_type)


def vocab_kv(wr, tokens, scores, types, chat_template: str | None = CHATML) -> None:
    """The tiny vocabulary's tokenizer keys (from vocab()), with its special ids and a chat template."""
    wr.add_tokenizer_model("llama")
    wr.add_token_list(tokens)
    wr.add_token_scores(scores)
    wr.add_token_types(types)
    wr.add_unk_token_id(0)
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    wr.add_add_bos_token(True)
    wr.add_add_eos_token(False)
    if chat_template is not None:
        wr.add_chat_template(chat_template)


def write_model(path: Path, seed: int, *, words=WORDS, n_embd=64, n_layer=2, n_head=4, n_ff=128,
                layer_std=0.6, bigram=0.5, n_ctx_train=2048, chat_template: str | None = CHATML) -> Path:
    """Random llama model. The output matrix is a random matrix plus `bigram` x a permutation of the
    token embeddings: each token strongly suggests a successor, the layers perturb it with context.
    That keeps greedy top-2 margins wide (0.1-5 logits) while outputs stay varied."""
    import gguf

    tokens, scores, types = vocab(words)
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    # 2-D weights in F16: this llama.cpp build's CPU F32 mat-mul path segfaults (seen with 0.3.36 here)
    def w(*shape, std=layer_std):
        return (rng.standard_normal(shape) * std / np.sqrt(shape[-1])).astype(np.float16)

    wr = gguf.GGUFWriter(str(path), "llama")
    llama_kv(wr, f"tiny-{seed}", n_ctx_train, n_embd, n_layer, n_ff, n_head, 1)  # file type: mostly F16
    vocab_kv(wr, tokens, scores, types, chat_template)

    emb = rng.standard_normal((n_vocab, n_embd)).astype(np.float32)
    wr.add_tensor("token_embd.weight", emb.astype(np.float16))
    for i in range(n_layer):
        p = f"blk.{i}."
        wr.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        wr.add_tensor(p + "attn_q.weight", w(n_embd, n_embd))
        wr.add_tensor(p + "attn_k.weight", w(n_embd, n_embd))
        wr.add_tensor(p + "attn_v.weight", w(n_embd, n_embd))
        wr.add_tensor(p + "attn_output.weight", w(n_embd, n_embd))
        wr.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        wr.add_tensor(p + "ffn_gate.weight", w(n_ff, n_embd))
        wr.add_tensor(p + "ffn_up.weight", w(n_ff, n_embd))
        wr.add_tensor(p + "ffn_down.weight", w(n_embd, n_ff))
    wr.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    out = rng.standard_normal((n_vocab, n_embd)).astype(np.float32) * (4.0 / np.sqrt(n_embd))
    out += emb[rng.permutation(n_vocab)] * bigram
    # end-of-generation tokens never win: the tests need long generations
    out[[0, 1, 2, 3, 4]] = 0.0
    wr.add_tensor("output.weight", out.astype(np.float16))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def greedy_margins(model, prompt_tokens, n_tokens):
    """Plain one-token-at-a-time greedy decoding; returns (tokens, min top-2 margin)."""
    model.clear()
    logits = model.decode(prompt_tokens, "last")[0]
    out, margin = [], np.inf
    for _ in range(n_tokens):
        top2 = np.partition(logits, -2)[-2:]
        margin = min(margin, float(top2[1] - top2[0]))
        t = int(np.argmax(logits))
        out.append(t)
        logits = model.decode([t], "last")[0]
    model.clear()
    return out, margin


def _common_header(wr, seed, n_ctx_train, chat_template, tokens, scores, types):
    wr.add_name(f"tiny-{seed}")
    wr.add_context_length(n_ctx_train)
    wr.add_file_type(1)  # mostly F16
    wr.add_tokenizer_model("llama")
    wr.add_token_list(tokens)
    wr.add_token_scores(scores)
    wr.add_token_types(types)
    wr.add_unk_token_id(0)
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    wr.add_add_bos_token(True)
    wr.add_add_eos_token(False)
    if chat_template is not None:
        wr.add_chat_template(chat_template)


def _output(rng, emb, n_vocab, n_embd, bigram, scale=1.0):
    out = rng.standard_normal((n_vocab, n_embd)).astype(np.float32) * (4.0 / np.sqrt(n_embd))
    out += emb[rng.permutation(n_vocab)] * bigram
    out *= scale
    out[[0, 1, 2, 3, 4]] = 0.0  # end-of-generation tokens never win
    return out.astype(np.float16)


def _finish(wr, path):
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def write_lfm2(path: Path, seed: int, *, words=WORDS, n_embd=64, layers="cac", n_head=4, n_ff=128, l_cache=3,
               layer_std=0.6, bigram=0.5, out_scale=1.0, n_ctx_train=2048,
               chat_template: str | None = CHATML) -> Path:
    """Random LFM2-style hybrid (llama.cpp arch `lfm2`): `layers` spells the stack, c = short convolution
    (recurrent state), a = attention (KV cache). Same vocab and output trick as write_model; out_scale < 1 spreads
    the next-token distribution (sampling tests)."""
    import gguf

    tokens, scores, types = vocab(words)
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head

    def w(*shape, std=layer_std):
        return (rng.standard_normal(shape) * std / np.sqrt(shape[-1])).astype(np.float16)

    wr = gguf.GGUFWriter(str(path), "lfm2")
    _common_header(wr, seed, n_ctx_train, chat_template, tokens, scores, types)
    wr.add_embedding_length(n_embd)
    wr.add_block_count(len(layers))
    wr.add_feed_forward_length(n_ff)
    wr.add_head_count(n_head)
    wr.add_head_count_kv([n_head if c == "a" else 0 for c in layers])
    wr.add_rope_dimension_count(head_dim)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_uint32("lfm2.shortconv.l_cache", l_cache)
    emb = rng.standard_normal((n_vocab, n_embd)).astype(np.float32)
    wr.add_tensor("token_embd.weight", emb.astype(np.float16))
    for i, kind in enumerate(layers):
        p = f"blk.{i}."
        wr.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        if kind == "a":
            wr.add_tensor(p + "attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
            wr.add_tensor(p + "attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
            wr.add_tensor(p + "attn_q.weight", w(n_embd, n_embd))
            wr.add_tensor(p + "attn_k.weight", w(n_embd, n_embd))
            wr.add_tensor(p + "attn_v.weight", w(n_embd, n_embd))
            wr.add_tensor(p + "attn_output.weight", w(n_embd, n_embd))
        else:
            wr.add_tensor(p + "shortconv.conv.weight",
                          (rng.standard_normal((n_embd, l_cache)) / np.sqrt(l_cache)).astype(np.float32))
            wr.add_tensor(p + "shortconv.in_proj.weight", w(3 * n_embd, n_embd))
            wr.add_tensor(p + "shortconv.out_proj.weight", w(n_embd, n_embd))
        wr.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        wr.add_tensor(p + "ffn_gate.weight", w(n_ff, n_embd))
        wr.add_tensor(p + "ffn_up.weight", w(n_ff, n_embd))
        wr.add_tensor(p + "ffn_down.weight", w(n_embd, n_ff))
    wr.add_tensor("token_embd_norm.weight", np.ones(n_embd, dtype=np.float32))
    wr.add_tensor("output.weight", _output(rng, emb, n_vocab, n_embd, bigram, out_scale))
    return _finish(wr, path)


def write_mamba(path: Path, seed: int, *, words=WORDS, n_embd=64, n_layer=2, d_state=8, d_conv=4, dt_rank=4,
                layer_std=0.6, bigram=0.5, n_ctx_train=2048, chat_template: str | None = CHATML) -> Path:
    """Random Mamba-1 (llama.cpp arch `mamba`; purely recurrent, no KV cache)."""
    import gguf

    tokens, scores, types = vocab(words)
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)
    d_inner = 2 * n_embd

    def w(*shape, std=layer_std):
        return (rng.standard_normal(shape) * std / np.sqrt(shape[-1])).astype(np.float16)

    wr = gguf.GGUFWriter(str(path), "mamba")
    _common_header(wr, seed, n_ctx_train, chat_template, tokens, scores, types)
    wr.add_embedding_length(n_embd)
    wr.add_block_count(n_layer)
    wr.add_feed_forward_length(0)
    wr.add_head_count(0)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_uint32("mamba.ssm.conv_kernel", d_conv)
    wr.add_uint32("mamba.ssm.inner_size", d_inner)
    wr.add_uint32("mamba.ssm.state_size", d_state)
    wr.add_uint32("mamba.ssm.time_step_rank", dt_rank)
    emb = rng.standard_normal((n_vocab, n_embd)).astype(np.float32)
    wr.add_tensor("token_embd.weight", emb.astype(np.float16))
    for i in range(n_layer):
        p = f"blk.{i}."
        wr.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        wr.add_tensor(p + "ssm_in.weight", w(2 * d_inner, n_embd))
        wr.add_tensor(p + "ssm_conv1d.weight",
                      (rng.standard_normal((d_inner, d_conv)) / np.sqrt(d_conv)).astype(np.float32))
        wr.add_tensor(p + "ssm_conv1d.bias", np.zeros(d_inner, dtype=np.float32))
        wr.add_tensor(p + "ssm_x.weight", w(dt_rank + 2 * d_state, d_inner))
        wr.add_tensor(p + "ssm_dt.weight", w(d_inner, dt_rank))
        wr.add_tensor(p + "ssm_dt.bias", np.full(d_inner, -2.0, dtype=np.float32))
        a = -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1))  # S4D-real init, as A = -exp(A_log)
        wr.add_tensor(p + "ssm_a", a)
        wr.add_tensor(p + "ssm_d", np.ones(d_inner, dtype=np.float32))
        wr.add_tensor(p + "ssm_out.weight", w(n_embd, d_inner))
    wr.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    wr.add_tensor("output.weight", _output(rng, emb, n_vocab, n_embd, bigram))
    return _finish(wr, path)


def write_no_vocab(path: Path) -> Path:
    """A llama-arch GGUF header without a tokenizer (no token list): no text can pass to or from it, so it can draft
    for nothing. Its one tensor is a placeholder: only its header is ever read."""
    import gguf

    wr = gguf.GGUFWriter(str(path), "llama")
    llama_kv(wr, "no-vocab", 2048, 64, 2, 128, 4, 1)
    wr.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    _finish(wr, path)
    return path
