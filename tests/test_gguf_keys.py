"""llama/gguf_keys.py: a GGUF file's scalar and string metadata, read by stepping over its arrays, agrees with gguf's
own reader; a truncated, foreign or missing file reads as {} (the load then says why)."""

from __future__ import annotations

import gguf

from conftest import REAL_MODELS
from localspec.llama import gguf_keys


def reference(path) -> dict:
    """Scalars and strings as gguf.GGUFReader reads them."""
    out = {}
    for name, f in gguf.GGUFReader(str(path)).fields.items():
        if name.startswith("GGUF.") or not f.types or f.types[0] == gguf.GGUFValueType.ARRAY:
            continue
        v = f.parts[f.data[0]]
        out[name] = bytes(v).decode("utf-8", "replace") if f.types[0] == gguf.GGUFValueType.STRING else v[0].item()
    return out


def test_the_metadata_is_what_gguf_reads(target_path, draft_path):
    for p in (target_path, draft_path):
        got = gguf_keys.metadata(p)
        assert got["general.architecture"] and got == reference(p)
    real = sorted(REAL_MODELS.glob("*.gguf")) if REAL_MODELS.is_dir() else []
    for p in real[:1]:  # a real tokenizer: 150k strings and merges stepped over
        assert gguf_keys.metadata(p) == reference(p)


def test_a_bad_file_reads_as_nothing(target_path, tmp_path):
    data = target_path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:300])  # inside the metadata
    foreign = tmp_path / "x.gguf"
    foreign.write_bytes(b"PK\x03\x04" + data[4:1000])
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    for p in (cut, foreign, empty, tmp_path / "missing.gguf"):
        assert gguf_keys.metadata(p) == {}
