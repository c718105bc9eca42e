"""Built-in values of the generation settings and their bounds, in one place: the settings schema (settings.py),
the engine's GenConfig, the model pairs and the front ends all read them from here."""

from __future__ import annotations

from localspec.drafters.registry import METHODS  # noqa: F401 - the method names, with the drafter kinds

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
AUTO_MIN_BIT_K = 2  # auto keeps bit-exactness when the probe's cap leaves at least this many draft tokens
