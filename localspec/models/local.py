"""GGUF files other runners already keep on this machine, used where they lie (read-only: nothing is copied, moved or
written there):

- Ollama's store (OLLAMA_MODELS, else ~/.ollama/models): manifests/HOST/NAMESPACE/MODEL/TAG, a JSON manifest whose
  layer of media type application/vnd.ollama.image.model names a blob, blobs/sha256-HEX. `-m`/`-d` take
  `ollama:NAME[:TAG]` (NAME as Ollama writes it: llama3.2, user/model, host/namespace/model; TAG default latest);
- LM Studio's models folders (~/.lmstudio/models, ~/.cache/lm-studio/models): PUBLISHER/REPO/FILE.gguf;
- llama.cpp's download cache (LLAMA_CACHE, else ~/.cache/llama.cpp, ~/Library/Caches/llama.cpp on macOS), where
  `llama-cli -hf` puts what it fetches.

The Hugging Face cache is listed by hubname.cached_models. `pairs()` says for the models found which can draft for
which and how, from their GGUF headers alone.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from localspec.errors import LocalspecError, UsageError
from localspec.models.spec import is_file, shown

OLLAMA_PREFIX = "ollama:"
OLLAMA_HOST = "registry.ollama.ai"
OLLAMA_NAMESPACE = "library"
OLLAMA_MODEL_MEDIA = "application/vnd.ollama.image.model"


@dataclass(frozen=True)
class LocalModel:
    source: str  # ollama | lm-studio | llama.cpp | hf-cache
    name: str  # what -m/-d take (ollama:NAME:TAG, a hub name) or the file's name
    path: Path
    size: int


def _home() -> Path:
    return Path(os.path.expanduser("~"))


# ------------------------------------------------------------------ Ollama
def ollama_root() -> Path:
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else _home() / ".ollama" / "models"


def is_ollama_name(s: str) -> bool:
    return s.startswith(OLLAMA_PREFIX)


def _ollama_parts(name: str) -> tuple[str, str, str, str]:
    """(host, namespace, model, tag) of NAME[:TAG] as Ollama reads it."""
    base, tag = name, "latest"
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        base, tag = name.rsplit(":", 1)
    parts = base.split("/")
    if len(parts) == 1:
        parts = [OLLAMA_HOST, OLLAMA_NAMESPACE, parts[0]]
    elif len(parts) == 2:
        parts = [OLLAMA_HOST, *parts]
    if len(parts) != 3 or not all(parts) or not tag or any(p in (".", "..") for p in (*parts, tag)):
        raise UsageError(f"invalid Ollama model name {shown(name)!r}: write ollama:NAME[:TAG] (e.g. ollama:llama3.2:1b)")
    return parts[0], parts[1], parts[2], tag


def _short(host: str, ns: str, model: str, tag: str) -> str:
    """The name as Ollama prints it (ollama list): the default host and namespace left out."""
    if host == OLLAMA_HOST:
        return f"{model}:{tag}" if ns == OLLAMA_NAMESPACE else f"{ns}/{model}:{tag}"
    return f"{host}/{ns}/{model}:{tag}"


MANIFEST_MAX = 1 << 20  # bytes: Ollama's manifests are a few hundred; a larger file is not one


def _read_manifest(manifest: Path) -> dict | None:
    """A manifest's JSON object, or None when it cannot be read as one: unreadable, too large, not JSON, or nested
    too deeply for the JSON reader (RecursionError). One damaged manifest must not break the others' lookups."""
    try:
        with open(manifest, "rb") as fh:
            raw = fh.read(MANIFEST_MAX + 1)
        if len(raw) > MANIFEST_MAX:
            return None
        data = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, RecursionError, MemoryError):
        return None
    return data if isinstance(data, dict) else None


def _manifest_blob(data: dict, root: Path) -> Path | None:
    """The model layer's blob a manifest names (None: a manifest without one)."""
    try:
        layers = data.get("layers") or []
        digest = next(la["digest"] for la in layers
                      if isinstance(la, dict) and la.get("mediaType") == OLLAMA_MODEL_MEDIA)
    except (StopIteration, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(digest, str) or ":" not in digest:
        return None
    algo, hexd = digest.split(":", 1)
    if not hexd.isalnum() or not algo.isalnum():
        return None  # a digest that is not a plain name must not lead anywhere else in the file system
    return root / "blobs" / f"{algo}-{hexd}"


def ollama_file(name: str) -> Path | None:
    """The blob an `ollama:` name points to now (None: not such a name)."""
    return ollama_path(name) if is_ollama_name(name) else None


def ollama_path(spec: str) -> Path:
    """The GGUF blob of `ollama:NAME[:TAG]` in Ollama's store, or a one-line UsageError that says what is there."""
    name = spec[len(OLLAMA_PREFIX):] if is_ollama_name(spec) else spec
    host, ns, model, tag = _ollama_parts(name)
    short = _short(host, ns, model, tag)
    root = ollama_root()
    manifest = root / "manifests" / host / ns / model / tag
    if not is_file(manifest, spec):
        known = [m.name[len(OLLAMA_PREFIX):] for m in ollama_models()]
        close = difflib.get_close_matches(short, known, n=3, cutoff=0.4)
        hint = (f"; did you mean {', '.join(OLLAMA_PREFIX + c for c in close)}?" if close else
                f" ({len(known)} model{'s' if len(known) != 1 else ''} there; `localspec models list --local` lists them)")
        raise UsageError(f"no Ollama model {short} in {root}{hint}")
    data = _read_manifest(manifest)
    if data is None:
        raise UsageError(f"Ollama model {short}: its manifest {manifest} cannot be read as Ollama's JSON "
                         "(ollama pull it again)")
    blob = _manifest_blob(data, root)
    if blob is None:
        raise UsageError(f"Ollama model {short} has no model layer in its manifest {manifest}")
    if not blob.is_file():
        raise UsageError(f"Ollama model {short}: its blob {blob} is missing (ollama pull it again)")
    return blob


def ollama_models() -> list[LocalModel]:
    """Every model in Ollama's store whose model layer is there."""
    root = ollama_root()
    out = []
    base = root / "manifests"
    if not base.is_dir():
        return out
    for manifest in sorted(base.glob("*/*/*/*")):
        if not manifest.is_file():
            continue
        host, ns, model, tag = manifest.relative_to(base).parts
        data = _read_manifest(manifest)
        blob = _manifest_blob(data, root) if data is not None else None  # a damaged manifest is skipped
        if blob is not None and blob.is_file():
            out.append(LocalModel("ollama", OLLAMA_PREFIX + _short(host, ns, model, tag), blob, blob.stat().st_size))
    return out


# ------------------------------------------------------------------ LM Studio, llama.cpp
def lmstudio_roots() -> list[Path]:
    return [_home() / ".lmstudio" / "models", _home() / ".cache" / "lm-studio" / "models"]


def llamacpp_cache() -> Path:
    env = os.environ.get("LLAMA_CACHE")
    if env:
        return Path(env).expanduser()
    if sys.platform == "darwin":
        return _home() / "Library" / "Caches" / "llama.cpp"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else _home() / ".cache") / "llama.cpp"


def _ggufs(root: Path, source: str) -> list[LocalModel]:
    from localspec.models.hubname import _is_model_gguf

    out = []
    if not root.is_dir():
        return out
    for p in sorted(root.rglob("*.gguf")):
        if p.is_file() and _is_model_gguf(p.name) and not p.name.endswith((".part", ".downloadInProgress")):
            out.append(LocalModel(source, p.relative_to(root).as_posix(), p, p.stat().st_size))
    return out


def hf_cache_models() -> list[LocalModel]:
    from localspec.models import hubname
    from localspec.models.download import local_path

    out = []
    for name, spec in hubname.cached_models():
        p = local_path(spec)
        if p is not None:
            out.append(LocalModel("hf-cache", name, p, p.stat().st_size))
    return out


def local_models(hf: bool = True, every_tag: bool = False) -> list[LocalModel]:
    """The GGUF models other runners keep here (and the HF cache's, with hf), each file once. every_tag: every
    Ollama name, also tags that share one blob (each is a name -m takes: a list shows them all; pairing judges a file
    once)."""
    found = ollama_models()
    for root in lmstudio_roots():
        found += _ggufs(root, "lm-studio")
    found += _ggufs(llamacpp_cache(), "llama.cpp")
    if hf:
        found += hf_cache_models()
    seen, out = set(), []
    for m in found:
        key = m.path.resolve()
        if key not in seen or (every_tag and m.source == "ollama"):
            seen.add(key)
            out.append(m)
    return out


# ------------------------------------------------------------------ which drafts for which
HOW_WORDS = {"same-vocab": "same vocabulary", "cross-vocab": "through text", "head": "head"}


def pairs(models: list[LocalModel]) -> tuple[list[dict], list[dict]]:
    """(pairs, unreadable): for every two models, whether the smaller can draft for the larger and how, from the GGUF
    headers alone: "same vocabulary" (its tokens are the target's), "through text" (another vocabulary), "head" (a
    draft head that fits the target). A draft head is never a target; a draft is smaller than its target."""
    from localspec.models.gguf_header import drafter_kind, not_a_target, pair_kind, read_file_metadata, HEAD_KINDS

    metas, bad = {}, []
    for m in models:
        try:
            metas[m.path] = read_file_metadata(m.path)
        except LocalspecError as exc:
            bad.append({"name": m.name, "path": str(m.path), "error": str(exc)})
    out = []
    readable = [m for m in models if m.path in metas]
    for t in readable:
        mt = metas[t.path]
        if not_a_target(mt) is not None:
            continue
        for d in readable:
            md = metas[d.path]
            if d is t or (d.size >= t.size and drafter_kind(md) not in HEAD_KINDS):
                continue
            kind, why = pair_kind(mt, md)
            if kind is None:
                continue
            out.append({"target": t.name, "target_source": t.source, "target_path": str(t.path),
                        "draft": d.name, "draft_source": d.source, "draft_path": str(d.path),
                        "how": HOW_WORDS[kind], "kind": kind, "vocab_difference": why,
                        "size_ratio": d.size / t.size if t.size else None})
    out.sort(key=lambda r: (r["target"], r["kind"] != "same-vocab", r["kind"] != "head", r["size_ratio"] or 0))
    return out, bad
