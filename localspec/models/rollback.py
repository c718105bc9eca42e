"""Which rollback a model gets, from its GGUF header alone (for `models info` and `doctor`: no llama.cpp load). The
lists are llama.cpp's (src/llama-arch.cpp at the vendored commit: llm_arch_is_recurrent, llm_arch_is_hybrid,
llm_arch_supports_rs_rollback); the loaded model decides for real (llama/model.py `rollback_kind`)."""

from __future__ import annotations

RECURRENT = {"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"}
HYBRID = {"jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe",
          "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next", "qwen35", "qwen35moe", "qwen4exp",
          "deepseek4", "minimax-01"}
RS_ROLLBACK = {"kimi-k3", "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "glm5-next", "nemotron_h", "nemotron_h_moe",
               "lfm2", "lfm2moe", "bailingmoe3"}

WORDS = {
    "kv": "kv (rejected drafts' cache rows are dropped)",
    "rs": "rs (recurrent-state planes: a rollback picks one, no replay)",
    "checkpoint": "checkpoint (recurrent state saved before each verify batch; restored and the accepted tokens "
                  "decoded again after a rejection)",
}


def kind_for_arch(arch: str) -> str:
    """kv | rs | checkpoint: how speculation undoes rejected drafts on a model of this architecture."""
    if arch in RS_ROLLBACK:
        return "rs"
    if arch in RECURRENT or arch in HYBRID:
        return "checkpoint"
    return "kv"
