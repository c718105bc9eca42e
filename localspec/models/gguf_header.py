"""Read a GGUF file's header and metadata (no tensors) from any binary stream: a local file, or a remote
file opened with ranged reads (HfFileSystem), so a pair can be checked before gigabytes are fetched."""

from __future__ import annotations

import struct
from typing import BinaryIO

from localspec.llama.vocab import VocabInfo
from localspec.errors import ModelLoadError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
VOCAB_TYPE = {"llama": "spm", "gpt2": "bpe", "bert": "wpm", "t5": "ugm", "rwkv": "rwkv", "plamo2": "plamo2", "no_vocab": "none"}
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4"}


class _Reader:
    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh

    def read(self, n: int) -> bytes:
        b = self.fh.read(n)
        if len(b) != n:
            raise ModelLoadError("truncated GGUF header")
        return b

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> bytes:
        n = self.unpack("<Q")
        if n > 1 << 24:
            raise ModelLoadError("corrupt GGUF: absurd string length")
        return self.read(n)

    def value(self, typ: int, keep_arrays: bool):
        if typ in _SCALARS:
            return self.unpack(_SCALARS[typ])
        if typ == _STRING:
            return self.string()
        if typ == _ARRAY:
            sub = self.unpack("<I")
            n = self.unpack("<Q")
            if n > 1 << 26:
                raise ModelLoadError("corrupt GGUF: absurd array length")
            if sub in _SCALARS and not keep_arrays:
                self.read(struct.calcsize(_SCALARS[sub]) * n)
                return n
            if sub in _SCALARS:
                size = struct.calcsize(_SCALARS[sub])
                data = self.read(size * n)
                return list(struct.unpack("<" + _SCALARS[sub][1] * n, data))
            return [self.value(sub, keep_arrays) for _ in range(n)]
        raise ModelLoadError(f"corrupt GGUF: unknown value type {typ}")


KEEP_ARRAYS = {"tokenizer.ggml.tokens"}


def read_metadata(fh: BinaryIO) -> dict:
    """Metadata key -> value (strings decoded; arrays other than the token list replaced by their length)."""
    r = _Reader(fh)
    if r.read(4) != b"GGUF":
        raise ModelLoadError("not a GGUF file (bad magic)")
    version = r.unpack("<I")
    if version < 2:
        raise ModelLoadError(f"GGUF version {version} is too old")
    n_tensors = r.unpack("<Q")
    n_kv = r.unpack("<Q")
    meta: dict = {"GGUF.version": version, "GGUF.tensor_count": n_tensors}
    for _ in range(n_kv):
        key = r.string().decode("utf-8", "replace")
        typ = r.unpack("<I")
        val = r.value(typ, keep_arrays=key in KEEP_ARRAYS)
        if isinstance(val, bytes):
            val = val.decode("utf-8", "replace") if key not in KEEP_ARRAYS else val
        meta[key] = val
    return meta


def read_file_metadata(path) -> dict:
    try:
        with open(path, "rb") as fh:
            return read_metadata(fh)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror}") from None


def vocab_info(meta: dict) -> VocabInfo:
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise ModelLoadError("GGUF has no tokenizer.ggml.tokens")
    model = meta.get("tokenizer.ggml.model", "llama")
    vt = VOCAB_TYPE.get(model, model)
    add_bos_default = vt in ("spm", "wpm")
    return VocabInfo(
        vocab_type=vt,
        n_vocab=len(tokens),
        bos=int(meta.get("tokenizer.ggml.bos_token_id", -1)),
        eos=int(meta.get("tokenizer.ggml.eos_token_id", -1)),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        token_text=tokens,
    )


def summary(meta: dict) -> dict:
    """Facts for `localspec models info`."""
    arch = meta.get("general.architecture", "?")
    ft = meta.get("general.file_type")
    tokens = meta.get("tokenizer.ggml.tokens")
    return {
        "name": meta.get("general.name"),
        "architecture": arch,
        "size_label": meta.get("general.size_label"),
        "quantization": FILE_TYPES.get(ft, str(ft) if ft is not None else None),
        "context_length": meta.get(f"{arch}.context_length"),
        "layers": meta.get(f"{arch}.block_count"),
        "embedding": meta.get(f"{arch}.embedding_length"),
        "vocab_type": VOCAB_TYPE.get(meta.get("tokenizer.ggml.model", ""), meta.get("tokenizer.ggml.model")),
        "vocab_size": len(tokens) if isinstance(tokens, list) else None,
        "chat_template": "tokenizer.chat_template" in meta,
        "tensors": meta.get("GGUF.tensor_count"),
    }
