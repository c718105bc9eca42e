"""Where a model file comes from: a hub repo + file (with mirrors, sha256, size) or a local path."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from localspec.errors import UsageError


@dataclass
class FileSpec:
    repo: str | None = None
    file: str | None = None
    revision: str | None = None
    sha256: str | None = None
    size: int | None = None
    mirrors: list[dict] = field(default_factory=list)
    path: str | None = None  # a local file (user pairs)

    @classmethod
    def from_dict(cls, d: dict) -> "FileSpec":
        return cls(**{k: d.get(k) for k in ("repo", "file", "revision", "sha256", "size", "path")}, mirrors=list(d.get("mirrors", [])))

    @classmethod
    def parse(cls, src: str) -> "FileSpec":
        """`hf://owner/repo/file.gguf[@revision]` or a local path."""
        if src.startswith("hf://"):
            rest = src[5:]
            rev = None
            if "@" in rest:
                rest, rev = rest.rsplit("@", 1)
            parts = rest.split("/")
            if len(parts) < 3 or not parts[-1]:
                raise UsageError(f"expected hf://OWNER/REPO/FILE.gguf, got {src}")
            return cls(repo="/".join(parts[:2]), file="/".join(parts[2:]), revision=rev)
        p = Path(src).expanduser()
        if not p.is_file():
            raise UsageError(f"no such file: {src}")
        return cls(path=str(p.resolve()))

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("repo", "file", "revision", "sha256", "size", "path") if getattr(self, k) is not None}
        if self.mirrors:
            d["mirrors"] = self.mirrors
        return d

    @property
    def label(self) -> str:
        return self.path or f"{self.repo}/{self.file}"
