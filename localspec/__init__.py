"""localspec: speculative decoding for local GGUF models, exact by construction."""

__version__ = "0.1.0"
