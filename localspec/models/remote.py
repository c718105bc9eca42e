"""A model file's GGUF header read before anything is downloaded: from a local copy, else from the hub with HTTP
range requests, to say whether a pair can speculate at all (vocabularies, a head's target)."""

from __future__ import annotations

from localspec.models import download
from localspec.models.spec import FileSpec


def remote_incompatibility(target: FileSpec, draft: FileSpec) -> str | None:
    """Why `draft` cannot speculate for `target`, read from the two GGUF headers before anything is downloaded:
    a local copy when there is one, else the hub with HTTP range requests. None when the pair is compatible, or
    when it cannot be checked now (offline, hub unreachable, ranged read refused): the load-time check remains.
    A draft head (eagle3, dflash) is judged as a head (the target's arch and layers), not by its vocabulary."""
    from localspec.models.gguf_header import pair_incompatibility

    metas = header_metadata(target, draft)
    return None if metas is None else pair_incompatibility(*metas)


def header_metadata(*specs: FileSpec) -> list[dict] | None:
    """The GGUF header metadata of each spec (a local copy, else the hub with HTTP range requests); None when one
    cannot be read now (offline, hub unreachable, ranged read refused)."""
    from localspec.errors import LocalspecError, ModelLoadError
    from localspec.models.gguf_header import read_file_metadata, read_metadata

    metas = []
    reach = None
    for spec in specs:
        lp = download.local_path(spec)
        if lp is not None:  # a local header that cannot be read is an error, never "cannot be checked now"
            metas.append(read_file_metadata(lp))
            continue
        try:
            if spec.path is not None or download.offline():
                return None
            if reach is None:
                reach = download.hub_reachable()
            if reach is not True:
                return None
            try:
                metas.append(read_metadata(RemoteFile(spec)))
            except ModelLoadError as exc:
                raise ModelLoadError(f"{spec.label}: {exc}") from None
        except LocalspecError:
            raise
        except Exception:
            return None  # the hub refused the ranged read: the check runs at load time
    return metas


class RemoteFile:
    """Read-only, seekless file over HTTP range requests (1 MiB blocks): enough to parse a GGUF header
    without downloading the file."""

    def __init__(self, spec: FileSpec, block: int = 1 << 20) -> None:
        from urllib.parse import quote

        from huggingface_hub.utils import build_hf_headers

        rev = quote(spec.revision or "main", safe="")
        self.url = f"{download.hf_endpoint()}/{spec.repo}/resolve/{rev}/{quote(spec.file)}"
        self.headers = build_hf_headers()
        self.block = block
        self.pos = 0
        self.buf = b""

    def _fetch(self, start: int) -> bytes:
        import urllib.request

        req = urllib.request.Request(self.url, headers={**self.headers, "Range": f"bytes={start}-{start + self.block - 1}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read()

    def read(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self._fetch(self.pos + len(self.buf))
            if not chunk:
                break
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        self.pos += len(out)
        return out
