"""Built-in values of the generation settings and their bounds, in one place: the settings schema (settings.py),
the engine's GenConfig, the model pairs and the front ends all read them from here. A leaf: reading a setting's
bounds loads no model code (`localspec config` imports neither numpy nor a drafter)."""

from __future__ import annotations

# the drafter kinds, by the method name that selects each (drafters/registry.py maps each to its class and checks
# that both lists agree); auto: the controller picks among them; none: plain decoding
DRAFTER_KINDS = ("draft", "lookup", "ngram", "suffix", "eagle3", "mtp", "dflash")
HEAD_KINDS = ("eagle3", "mtp", "dflash")  # drafters built on the target's own context
METHODS = ("auto", *DRAFTER_KINDS, "none")

EXACTNESS = ("auto", "bit", "lossless")
KV_LAYOUTS = ("auto", "split", "unified")  # serve --kv-layout: where batched slots keep their KV (core/batch.py)
METHOD = "auto"
EXACTNESS_LEVEL = "auto"
DRAFT_TOKENS = 4  # k when neither the pair nor the user says
MAX_K = 64
MAX_TOKENS = 512
CTX_SIZE = 4096
MIN_CTX = 16
P_MIN = 0.75
LOOKUP_MIN = 2
LOOKUP_MAX = 4
SUFFIX_CACHE_TOKENS = 100_000  # tokens of earlier prompts and answers the suffix drafter keeps (~0.6 MB on disk)
PROMPT_CACHE_BYTES = 4 << 30  # disk budget of the prompt states (store/prompt_states.py)
AUTO_MIN_BIT_K = 2  # auto keeps bit-exactness when the probe's cap leaves at least this many draft tokens
