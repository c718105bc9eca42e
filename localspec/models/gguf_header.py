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


# arrays of arrays deeper than this are refused: GGUF writers nest at most once (llama.cpp reads no nesting at all),
# and a deeper header would only exhaust the reader's recursion
MAX_ARRAY_DEPTH = 4


class _Reader:
    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh
        self.depth = 0

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
            if self.depth >= MAX_ARRAY_DEPTH:
                raise ModelLoadError(f"corrupt GGUF: arrays nested more than {MAX_ARRAY_DEPTH} deep")
            self.depth += 1
            try:
                return [self.value(sub, keep_arrays) for _ in range(n)]
            finally:
                self.depth -= 1
        raise ModelLoadError(f"corrupt GGUF: unknown value type {typ}")


KEEP_ARRAYS = {"tokenizer.ggml.tokens"}


def read_metadata(fh: BinaryIO, tokens: bool = True) -> dict:
    """Metadata key -> value (strings decoded; arrays other than the token list and a draft head's target layers
    replaced by their length; tokens=False: the token list too, for a quick look at a model's kind)."""
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
        val = r.value(typ, keep_arrays=(tokens and key in KEEP_ARRAYS) or key.endswith(".target_layers"))  # a head's few ids
        if isinstance(val, bytes):
            val = val.decode("utf-8", "replace") if key not in KEEP_ARRAYS else val
        meta[key] = val
    return meta


def read_file_metadata(path, tokens: bool = True) -> dict:
    """read_metadata of a local file; any failure is a ModelLoadError that names the file."""
    try:
        with open(path, "rb") as fh:
            return read_metadata(fh, tokens)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror}") from None
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None


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


HEAD_KINDS = ("eagle3", "dflash")
HEAD_NAMES = {"eagle3": "an EAGLE-3 draft head", "dflash": "a DFlash draft head"}  # each with its article


def not_a_target(meta: dict) -> str | None:
    """What this GGUF is when it cannot be the model that generates (a draft head, or a file whose every layer is
    an MTP layer: it has no trunk to run), in words with its article; None for a model."""
    kind = drafter_kind(meta)
    if kind in HEAD_NAMES:
        return HEAD_NAMES[kind]
    arch = meta.get("general.architecture", "")
    n_layer = meta.get(f"{arch}.block_count")
    if kind == "mtp" and isinstance(n_layer, int) and n_layer <= nextn_layers(meta):
        return "a file of MTP layers only, with no model to run them on"
    return None


def nextn_layers(meta: dict) -> int:
    """How many MTP (nextn) layers the model carries ({arch}.nextn_predict_layers; 0: none)."""
    arch = meta.get("general.architecture", "")
    try:
        return int(meta.get(f"{arch}.nextn_predict_layers") or 0)
    except (TypeError, ValueError):
        return 0


def drafter_kind(meta: dict) -> str | None:
    """What this GGUF drafts as: "eagle3" or "dflash" (a draft head, -d), "mtp" (a target with its own MTP layers),
    None (a plain model: a target, or a draft model for one)."""
    from localspec.llama.headarchs import HEAD_ARCHS

    kind = HEAD_ARCHS.get(str(meta.get("general.architecture", "")))
    if kind is not None:
        return kind
    return "mtp" if nextn_layers(meta) > 0 else None


def drafter_words(meta: dict, role: str) -> str:
    """drafter_kind in words, for `models info` and `models add`."""
    kind = drafter_kind(meta)
    if kind == "dflash" and "dflash.has_confidence_head" in meta:  # llama.cpp's DSpark converters always write it
        return "dflash (a DSpark draft head, DFlash plus a Markov head, on the target's hidden states)"
    if kind in HEAD_KINDS:
        return f"{kind} (a draft head on the target's hidden states)"
    if kind == "mtp":
        n = nextn_layers(meta)
        return f"mtp ({n} MTP layer{'s' if n != 1 else ''} in the model itself: --method mtp, no draft needed)"
    return "draft model" if role == "draft" else "none (a plain model)"


def head_incompatibility(target: dict, head: dict) -> str | None:
    """Why draft head `head` (eagle3, dflash) cannot run on `target`, from the two headers (None: it can, as far as
    the headers tell; the load-time checks remain)."""
    from localspec.llama.headarchs import LAYER_INP_ARCHS

    kind = drafter_kind(head)
    t_arch = str(target.get("general.architecture", "?"))
    h_arch = str(head.get("general.architecture", "?"))
    if t_arch not in LAYER_INP_ARCHS:
        return (f"{kind} needs the target's layer hidden states, which llama.cpp does not extract for {t_arch}-arch "
                "models")
    layers = head.get(f"{h_arch}.target_layers")
    n_layer = target.get(f"{t_arch}.block_count")
    if isinstance(layers, list) and isinstance(n_layer, int):
        n_trunk = n_layer - nextn_layers(target)
        bad = [x for x in layers if not isinstance(x, int) or not 0 <= x < n_trunk]
        if bad:
            return f"the {kind} head reads target layers {layers}, the target has {n_trunk}"
    hidden = head.get("eagle3.target_hidden_size") if kind == "eagle3" else None
    n_embd = target.get(f"{t_arch}.embedding_length")
    if isinstance(hidden, int) and isinstance(n_embd, int) and hidden != n_embd:
        return f"the {kind} head was trained on a target of hidden size {hidden}, the target has {n_embd}"
    t_tok, h_tok = target.get("tokenizer.ggml.tokens"), head.get("tokenizer.ggml.tokens")
    if isinstance(t_tok, list) and isinstance(h_tok, list) and len(t_tok) != len(h_tok):
        return f"the {kind} head has a vocabulary of {len(h_tok)} tokens, the target {len(t_tok)}"
    if kind == "dflash" and "tokenizer.ggml.mask_token_id" not in head:
        return "the dflash head declares no mask token (tokenizer.ggml.mask_token_id)"
    return None


def pair_incompatibility(target: dict, draft: dict) -> str | None:
    """Why `draft` cannot speculate for `target` (a draft model: it needs a tokenizer on both sides; a draft head:
    head_incompatibility); None when it can."""
    kind, why = pair_kind(target, draft)
    return why if kind is None else None


def pair_kind(target: dict, draft: dict) -> tuple[str | None, str | None]:
    """How `draft` would draft for `target`, from the two headers: ("head", None) for a draft head that fits,
    ("same-vocab", None), ("cross-vocab", the vocabularies' first difference), or (None, why it cannot)."""
    from localspec.models.pair import pair_kind as vocab_pair_kind

    if drafter_kind(draft) in HEAD_KINDS:
        why = head_incompatibility(target, draft)
        return (None, why) if why else ("head", None)
    return vocab_pair_kind(header_vocab(target), header_vocab(draft))


def header_vocab(meta: dict) -> VocabInfo:
    """vocab_info, or an empty vocabulary of type "none" for a file without a token list."""
    if not isinstance(meta.get("tokenizer.ggml.tokens"), list):
        return VocabInfo(vocab_type="none", n_vocab=0, bos=-1, eos=-1, add_bos=False, add_eos=False)
    return vocab_info(meta)
