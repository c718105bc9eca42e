"""Models other runners keep on this machine (Ollama's store, LM Studio's folders, llama.cpp's cache): used where
they lie, listed with their paths, paired by their headers; nothing is written there."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import one_error_line


def cli(args, home: Path, extra=None):
    env = {**os.environ, "HOME": str(home), **(extra or {})}
    env.pop("OLLAMA_MODELS", None)
    env.pop("LLAMA_CACHE", None)
    env.pop("XDG_CACHE_HOME", None)
    env.update(extra or {})
    return subprocess.run([sys.executable, "-m", "localspec", *args], capture_output=True, env=env, timeout=300)


def ollama_add(root: Path, name: str, tag: str, data: bytes, ns: str = "library") -> Path:
    """An Ollama store entry as `ollama pull` leaves it: the blob by digest, the manifest naming it."""
    digest = hashlib.sha256(data).hexdigest()
    blob = root / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    cfg = b'{"model_format":"gguf"}'
    cdig = hashlib.sha256(cfg).hexdigest()
    (root / "blobs" / f"sha256-{cdig}").write_bytes(cfg)
    manifest = root / "manifests" / "registry.ollama.ai" / ns / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": f"sha256:{cdig}",
                   "size": len(cfg)},
        "layers": [{"mediaType": "application/vnd.ollama.image.template", "digest": f"sha256:{cdig}", "size": 1},
                   {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
                    "size": len(data)}]}))
    return blob


def tree(root: Path) -> dict:
    """Every file under root with its size and modification time (what a write would change), and the folders."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else "folder"
            for p in sorted(root.rglob("*"))}


@pytest.fixture
def home(tmp_path, env, target_path, draft_path, other_vocab_path):
    """A home with an Ollama store (the target, under two names), LM Studio's folder (the same-vocab draft, larger
    than nothing: a small copy) and llama.cpp's cache (the other-vocabulary draft)."""
    h = tmp_path / "home"
    store = h / ".ollama" / "models"
    ollama_add(store, "tiny", "latest", target_path.read_bytes())
    ollama_add(store, "tiny", "big", target_path.read_bytes() + b"")  # the same blob under another tag
    lm = h / ".lmstudio" / "models" / "someone" / "tiny-GGUF" / "tiny-draft.gguf"
    lm.parent.mkdir(parents=True)
    lm.write_bytes(draft_path.read_bytes())
    lc = h / ".cache" / "llama.cpp" / "other_tiny-other.gguf"
    lc.parent.mkdir(parents=True)
    lc.write_bytes(other_vocab_path.read_bytes())
    return h


def test_ollama_name_runs_from_the_store(home):
    before = tree(home)
    lm = home / ".lmstudio" / "models" / "someone" / "tiny-GGUF" / "tiny-draft.gguf"
    r = cli(["run", "-m", "ollama:tiny", "-d", str(lm), "--method", "draft", "-n", "6", "--json", "--raw", "hi"], home)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["target"].startswith("sha256-") and out["draft_kind"] == "same-vocab" and out["completion_tokens"] == 6
    r = cli(["run", "-m", "ollama:tiny:big", "-d", str(home / ".cache/llama.cpp/other_tiny-other.gguf"), "-n", "4",
             "--json", "--raw", "hi"], home)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["draft_kind"] == "cross-vocab"
    assert tree(home) == before  # nothing written, moved or copied there


def test_ollama_models_override_and_errors(home, tmp_path):
    r = cli(["run", "-m", "ollama:tiny:nope", "-n", "2", "hi"], home)
    lines = r.stderr.decode().strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: no Ollama model tiny:nope in ")
    assert "ollama:tiny:latest" in lines[0]  # the close names
    r = cli(["run", "-m", "ollama:a/b/c/d", "-n", "2", "hi"], home)
    assert r.returncode == 2 and b"invalid Ollama model name" in r.stderr
    # OLLAMA_MODELS moves the store
    moved = tmp_path / "elsewhere"
    (home / ".ollama" / "models").rename(moved)
    r = cli(["models", "info", "ollama:tiny", "--json"], home, {"OLLAMA_MODELS": str(moved)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"]["path"].startswith(str(moved / "blobs" / "sha256-"))
    r = cli(["models", "info", "ollama:tiny"], home)
    assert r.returncode == 2 and b"no Ollama model tiny:latest" in r.stderr
    # a manifest whose model blob is gone
    blob = next((moved / "blobs").glob("sha256-*"))
    for b in (moved / "blobs").glob("sha256-*"):
        if b.stat().st_size > 1000:
            blob = b
    blob.unlink()
    r = cli(["models", "info", "ollama:tiny"], home, {"OLLAMA_MODELS": str(moved)})
    assert r.returncode == 2 and b"is missing" in r.stderr and len(r.stderr.decode().strip().splitlines()) == 1


def test_list_local_shows_every_store_with_paths(home):
    before = tree(home)
    r = cli(["models", "list", "--local", "--json"], home)
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    tags = ["ollama:tiny:latest", "ollama:tiny:big"]  # two tags of one blob: each is a name -m takes
    assert all(n in rows for n in tags), sorted(rows)
    assert {rows[t]["source"] for t in tags} == {"ollama"}
    assert rows[tags[0]]["target"]["path"] == rows[tags[1]]["target"]["path"]
    assert rows[tags[0]]["target"]["path"].startswith(str(home / ".ollama" / "models" / "blobs"))
    assert rows["someone/tiny-GGUF/tiny-draft.gguf"]["source"] == "lm-studio"
    assert rows["other_tiny-other.gguf"]["target"]["path"] == str(home / ".cache/llama.cpp/other_tiny-other.gguf")
    r = cli(["models", "list", "--local"], home)
    assert r.returncode == 0 and b"tiny-draft.gguf" in r.stdout
    assert b"ollama:tiny:latest" in r.stdout and b"ollama:tiny:big" in r.stdout
    # LLAMA_CACHE moves llama.cpp's cache
    r = cli(["models", "list", "--local", "--json"], home, {"LLAMA_CACHE": str(home / "nowhere")})
    assert "other_tiny-other.gguf" not in {row["name"] for row in json.loads(r.stdout)}
    assert tree(home) == before


def test_models_pairs_says_how_each_drafts(home, target_path, draft_path):
    before = tree(home)
    r = cli(["models", "pairs", "--json"], home)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    how = {(p["target"], p["draft"]): p["how"] for p in res["pairs"]}
    assert res["unreadable"] == []
    # the tiny files are all the same size: a draft must be smaller than its target, so none pairs yet
    assert target_path.stat().st_size == draft_path.stat().st_size and how == {}
    # a larger target: the same weights with padding after the tensors
    big = home / ".lmstudio" / "models" / "someone" / "tiny-GGUF" / "tiny-big.gguf"
    big.write_bytes(target_path.read_bytes() + b"\0" * 4096)
    r = cli(["models", "pairs", "--json"], home)
    how = {(p["target"], p["draft"]): p["how"] for p in json.loads(r.stdout)["pairs"]}
    big_name = "someone/tiny-GGUF/tiny-big.gguf"
    assert how[(big_name, "someone/tiny-GGUF/tiny-draft.gguf")] == "same vocabulary"
    assert {how.get((big_name, f"ollama:tiny:{t}")) for t in ("big", "latest")} == {"same vocabulary", None}
    assert how[(big_name, "other_tiny-other.gguf")] == "through text"
    r = cli(["models", "pairs"], home)
    assert r.returncode == 0 and b"through text" in r.stdout and b"same vocabulary" in r.stdout
    big.unlink()
    assert tree(home) == before


def test_models_info_says_how_a_pair_drafts(home, env, target_path, other_vocab_path, draft_path):
    for d, kind, words in ((other_vocab_path, "cross-vocab", "drafts through text"),
                           (draft_path, "same-vocab", "drafts with the same vocabulary")):
        r = cli(["models", "add", "p", "--target", str(target_path), "--draft", str(d)], home)
        assert r.returncode == 0, r.stderr
        info = json.loads(cli(["models", "info", "p", "--json"], home).stdout)
        assert info["compatible"] is True and info["drafting"] == kind
        r = cli(["models", "info", "p"], home)
        assert words.encode() in r.stdout, r.stdout
        assert cli(["models", "rm", "p", "--yes", "--keep-files"], home).returncode == 0


def damage(store: Path, name: str, text: str) -> Path:
    """A manifest for `name` (tag latest) holding `text` instead of Ollama's JSON."""
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / name / "latest"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(text)
    return manifest


def test_a_damaged_manifest_hides_no_other_model(home):
    """A manifest nested too deeply for the JSON reader, or not JSON at all, is skipped in the list and in every
    lookup; the model it belongs to is one error line naming its manifest."""
    store = home / ".ollama" / "models"
    damage(store, "deep", "[" * 100_000 + "]" * 100_000)
    damage(store, "garbage", "\x00not json")
    damage(store, "nolayer", json.dumps({"layers": [{"mediaType": "x", "digest": "sha256:00"}]}))
    before = tree(home)
    r = cli(["models", "list", "--local", "--json"], home)
    assert r.returncode == 0, r.stderr
    names = {row["name"] for row in json.loads(r.stdout)}
    assert {"ollama:tiny:latest", "ollama:tiny:big"} <= names and not any("deep" in n or "garbage" in n for n in names)
    assert cli(["models", "list", "--local"], home).returncode == 0
    r = cli(["models", "info", "ollama:tiny", "--json"], home)
    assert r.returncode == 0, r.stderr
    line = one_error_line(cli(["models", "info", "ollama:tiny:nope"], home))
    assert "no Ollama model tiny:nope" in line and "ollama:tiny:latest" in line
    for name in ("deep", "garbage"):
        line = one_error_line(cli(["models", "info", f"ollama:{name}"], home))
        assert f"Ollama model {name}:latest" in line and "manifest" in line and "cannot be read" in line, line
    line = one_error_line(cli(["run", "-m", "ollama:deep", "-n", "2", "hi"], home))
    assert "cannot be read" in line
    line = one_error_line(cli(["models", "info", "ollama:nolayer"], home))
    assert "no model layer" in line
    r = cli(["models", "pairs", "--json"], home)
    assert r.returncode == 0, r.stderr
    assert tree(home) == before


def test_models_add_reads_ollama_names(home):
    """`models add --target/--draft ollama:NAME[:TAG]` take the blob that name stands for now, as -m does; removing the
    pair leaves Ollama's store as it was."""
    before = tree(home / ".ollama")
    r = cli(["models", "add", "mine", "--target", "ollama:tiny:big", "--draft", "ollama:tiny"], home)
    assert r.returncode == 0, r.stderr
    info = json.loads(cli(["models", "info", "mine", "--json"], home).stdout)
    blobs = str(home / ".ollama" / "models" / "blobs" / "sha256-")
    assert info["target"]["path"].startswith(blobs) and info["draft"]["path"].startswith(blobs)
    line = one_error_line(cli(["models", "add", "other", "--target", "ollama:tiny:nope"], home))
    assert "no Ollama model tiny:nope" in line
    line = one_error_line(cli(["models", "add", "other", "--target", "ollama:a/b/c/d"], home))
    assert "invalid Ollama model name" in line
    r = cli(["models", "rm", "mine", "--yes"], home)
    assert r.returncode == 0, r.stderr
    assert tree(home / ".ollama") == before


def test_models_rm_of_a_name_that_is_no_pair(home, target_path):
    """`models rm` of an Ollama name or a file says what it is, in one line, and suggests no unrelated pair;
    suggestions come only for a name close to a pair's."""
    before = tree(home)
    for name in ("ollama:x", "ollama:tiny"):
        line = one_error_line(cli(["models", "rm", name, "--yes"], home))
        assert "Ollama" in line and "did you mean" not in line, line
    line = one_error_line(cli(["models", "rm", str(target_path), "--yes"], home))
    assert "did you mean" not in line and "file" in line, line
    line = one_error_line(cli(["models", "rm", "gemma-12", "--yes"], home))
    assert "did you mean gemma3-12b" in line
    line = one_error_line(cli(["models", "rm", "smol", "--yes"], home))
    assert "did you mean smollm2-135m, smollm2-1.7b" in line
    line = one_error_line(cli(["models", "rm", "mistral-7b", "--yes"], home))
    assert line.startswith("error: unknown model pair 'mistral-7b'") and "did you mean" not in line, line
    assert tree(home) == before
