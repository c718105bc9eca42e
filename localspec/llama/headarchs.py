"""Which llama.cpp architectures the draft heads work with (src/models/*.cpp at the vendored commit): plain data, so
`models info` and `doctor` can judge a pair from GGUF headers without loading llama.cpp."""

from __future__ import annotations

# archs whose graph fills `t_layer_inp` (EAGLE-3 and DFlash read the target's layer inputs): setting
# llama_set_embeddings_layer_inp on any other target aborts the process at its next decode (qwen2, gemma3, ...)
LAYER_INP_ARCHS = frozenset({
    "llama", "qwen3", "qwen3moe", "qwen3next", "qwen35", "qwen35moe", "qwen4exp", "gemma3n", "gemma4",
    "muse-glimmer", "deepseek4", "nemotron_h", "bailingmoe3", "hunyuan_vl", "gpt-oss", "lfm2", "minimax-01",
    "minimax-m2", "mimo2", "nanbeige",
})

HEAD_ARCHS = {"eagle3": "eagle3", "dflash": "dflash"}  # a draft GGUF's general.architecture -> drafter kind

# archs whose MTP graph builds any of n_layer_nextn layers, chosen by llama_set_nextn_layer_offset (chained heads);
# the other MTP graphs assert n_layer_nextn == 1
CHAIN_MTP_ARCHS = frozenset({"step35", "mimo2", "hy-v3"})
