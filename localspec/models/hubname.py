"""Model names on the Hugging Face hub, as `-m`/`-d` and `models add` accept them:

    hf://OWNER/REPO/PATH/FILE.gguf[@REV]    one file (also hf.co/…, huggingface.co/… and their https:// URLs)
    OWNER/REPO[:QUANT][@REV]                 the repo's GGUF for QUANT (default Q4_K_M), as llama.cpp's `-hf`
    hf.co/OWNER/REPO[:QUANT]                 the same, as Ollama writes it

parse() and pick() are pure; resolve() lists the repo's files on the hub (HF_ENDPOINT), or, with HF_HUB_OFFLINE=1
or an unreachable hub, in the local Hugging Face cache."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from localspec.errors import DownloadError, UsageError
from localspec.models.spec import FileSpec, check_gguf_file, check_relpath, check_repo, is_file, shown, user_path

DEFAULT_QUANT = "Q4_K_M"
_PREFIXES = ("hf://", "https://huggingface.co/", "http://huggingface.co/", "https://hf.co/", "http://hf.co/",
             "huggingface.co/", "hf.co/")
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REPO_FORM = re.compile(rf"^({_PART}/{_PART})(?::([A-Za-z0-9._-]+))?(?:@([A-Za-z0-9._/-]+))?$")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.I)
_QUANT = re.compile(r"(?<![A-Za-z0-9])((?:I?Q|TQ)\d+(?:_[A-Za-z0-9]+)*|B?F16|F32|MXFP4(?:_MOE)?)(?![A-Za-z0-9])", re.I)
FORMS = "hf://OWNER/REPO/FILE.gguf[@REV] or OWNER/REPO[:QUANT]"


@dataclass(frozen=True)
class HubName:
    repo: str
    file: str | None = None  # an exact file; else picked by quant
    quant: str | None = None  # None: DEFAULT_QUANT
    revision: str | None = None

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        if self.file:
            return f"hf://{self.repo}/{self.file}{rev}"
        return f"{self.repo}:{(self.quant or DEFAULT_QUANT).upper()}{rev}"


@dataclass(frozen=True)
class RepoFile:
    path: str
    size: int | None = None
    revision: str | None = None  # the cached snapshot it was found in (offline listing)


def is_hub_name(s: str) -> bool:
    """Written as a hub name (not checked against files or pairs)."""
    try:
        return parse(s) is not None
    except UsageError:
        return True  # an hf:// name, malformed: parse() will say why


def parse(s: str) -> HubName | None:
    """The hub name `s` spells, or None when it is not written as one. A prefixed (hf://, hf.co/) but malformed
    name is a UsageError, and so is a repo, file or revision the hub would refuse (`..`, absolute parts,
    backslashes, control characters: see spec.check_relpath). A bare `A/B` is a repo; a bare name with more
    slashes or ending in .gguf is a path."""
    s = s.strip()
    low = s.lower()
    prefix = next((p for p in _PREFIXES if low.startswith(p)), None)
    if prefix is None:
        if s.count("/") != 1 or low.endswith(".gguf"):
            return None
        m = _REPO_FORM.match(s)
        if not m:
            return None
        try:
            return _checked(HubName(m.group(1), quant=m.group(2), revision=m.group(3)))
        except UsageError:
            return None  # not a name the hub could have: a path or a pair name
    rest = s[len(prefix):].strip("/")
    parts = rest.split("/")
    if len(parts) <= 2:
        m = _REPO_FORM.match(rest)
        if not m:
            raise UsageError(f"expected {FORMS}, got {shown(s)!r}")
        return _checked(HubName(m.group(1), quant=m.group(2), revision=m.group(3)))
    repo, path = "/".join(parts[:2]), parts[2:]
    rev = None
    if len(path) >= 3 and path[0] in ("resolve", "blob"):  # a pasted https://huggingface.co/O/R/blob/REV/F URL
        rev, path = path[1], path[2:]
    file = "/".join(path)
    if "@" in file:
        file, rev = file.rsplit("@", 1)
    file = file.split("?")[0]
    if not re.fullmatch(rf"{_PART}/{_PART}", repo) or not file or not rev and rev is not None:
        raise UsageError(f"expected {FORMS}, got {shown(s)!r}")
    return _checked(HubName(repo, file=file, revision=rev or None))


QUANT_MAX = 32  # characters: the longest quant names (IQ4_XS, Q4_K_M, MXFP4_MOE, ...) are far shorter


def _checked(h: HubName) -> HubName:
    check_repo(h.repo)
    if h.quant is not None and len(h.quant) > QUANT_MAX:
        raise UsageError(f"invalid quant {shown(h.quant)!r}: at most {QUANT_MAX} characters")
    if h.file is not None:
        check_relpath(h.file, "file")
    if h.revision is not None:
        check_relpath(h.revision, "revision")
    return h


def quant_of(filename: str) -> str | None:
    """The quantization a GGUF's file name states (Q4_K_M, IQ4_XS, Q8_0, F16 ...), upper-case."""
    name = _SPLIT.sub(".gguf", Path(filename).name)
    found = _QUANT.findall(name)
    return found[-1].upper() if found else None


def _is_model_gguf(path: str) -> bool:
    name = Path(path).name.lower()
    return name.endswith(".gguf") and "mmproj" not in name  # vision projectors are not language models


def available(files: list[RepoFile]) -> list[str]:
    """The quants on offer (or file names that state none), for error messages."""
    out = []
    for f in files:
        if _is_model_gguf(f.path):
            q = quant_of(f.path) or Path(_SPLIT.sub(".gguf", f.path)).name
            if q not in out:
                out.append(q)
    return sorted(out, key=lambda q: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", q)])


def pick(files: list[RepoFile], repo: str, quant: str | None = None) -> RepoFile:
    """The GGUF in `files` for `quant` (default Q4_K_M): the file whose name states that quant, else whose name
    contains it (case-insensitive); a single file beats split parts. Ambiguity or no match is a UsageError."""
    ggufs = [f for f in files if _is_model_gguf(f.path)]
    if not ggufs:
        raise UsageError(f"{repo} has no GGUF files (localspec runs GGUF models: look for a -GGUF repo)")
    want = (quant or DEFAULT_QUANT).upper()
    found = [f for f in ggufs if quant_of(f.path) == want]
    if not found:
        found = [f for f in ggufs if want in Path(f.path).name.upper()]
    if not found and quant is None and len({_SPLIT.sub("", f.path) for f in ggufs}) == 1:
        found = ggufs  # no quant asked for and only one model in the repo: that one
    if not found:
        what = f"no {want} GGUF" if quant else f"no {want} GGUF (the default)"
        raise UsageError(f"{repo} has {what}; choose one of: " + ", ".join(f"{repo}:{q}" for q in available(ggufs)))
    single = [f for f in found if not _SPLIT.search(f.path)]
    if not single:
        first = sorted(found, key=lambda f: f.path)[0]
        n = int(_SPLIT.search(first.path).group(2))
        raise UsageError(
            f"{repo}:{want} is split into {n} parts ({Path(first.path).name}); split GGUFs are not supported yet: "
            "merge them (llama-gguf-split --merge FIRST-PART OUT.gguf) and pass the path, or choose another quant"
        )
    if len(single) > 1:
        names = ", ".join(f"hf://{repo}/{f.path}" for f in sorted(single, key=lambda f: f.path))
        raise UsageError(f"{repo}:{want} matches {len(single)} files; name one: {names}")
    return single[0]


# ---------------------------------------------------------------- listing (network or cache)
def cached_files(repo: str, revision: str | None = None) -> list[RepoFile]:
    """Complete files of `repo` in the local HF cache: the snapshot `revision` (default main) names first, then the
    other snapshots (each file marked with its snapshot's commit so that it is found again offline)."""
    from localspec.models.download import hf_cache

    root = Path(hf_cache()) / f"models--{repo.replace('/', '--')}"
    snaps = root / "snapshots"
    if not snaps.is_dir():
        return []
    ref = root / "refs" / (revision or "main")
    head = ref.read_text().strip() if ref.is_file() else revision
    dirs = [snaps / head] if head and (snaps / head).is_dir() else []
    if revision is None:
        dirs += sorted(d for d in snaps.iterdir() if d.is_dir() and d not in dirs)
    out: dict[str, RepoFile] = {}
    for d in dirs:
        for p in sorted(d.rglob("*")):
            rel = p.relative_to(d).as_posix()
            if rel not in out and p.is_file():  # a link to a missing blob is no file
                out[rel] = RepoFile(rel, p.stat().st_size, None if d.name == head and revision is None else d.name)
    return list(out.values())


def list_files(repo: str, revision: str | None = None) -> list[RepoFile]:
    """The repo's files: from the hub, or from the cache when offline (HF_HUB_OFFLINE=1) or unreachable."""
    from localspec.models import download

    if download.offline():
        cached = cached_files(repo, revision)
        if not cached:
            raise DownloadError(f"{repo} is not in the local cache and HF_HUB_OFFLINE=1 is set; "
                                "pull it while online, or pass a local GGUF path")
        return cached
    reach = download.hub_reachable()
    if reach is True:
        from huggingface_hub import HfApi
        from huggingface_hub import RepoFile as HubFile
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

        endpoint = download.hf_endpoint()
        try:
            tree = HfApi(endpoint=endpoint).list_repo_tree(repo, recursive=True, revision=revision)
            return [RepoFile(f.path, f.size) for f in tree if isinstance(f, HubFile)]
        except RevisionNotFoundError:
            raise UsageError(f"{repo} has no revision {revision!r}") from None
        except RepositoryNotFoundError:
            raise UsageError(f"no model repo {repo} on {endpoint} (or it is private or gated: log in with "
                             "`hf auth login`)") from None
        except Exception as exc:  # a dropped connection, a 5xx: the cache may still have it
            reach = f"{type(exc).__name__}"
    cached = cached_files(repo, revision)
    if cached:
        return cached
    raise DownloadError(f"cannot list the files of {repo}: hub {reach}; check the network, or pass a local GGUF path")


def resolve(h: HubName):
    """The FileSpec a hub name stands for (a file listing for OWNER/REPO[:QUANT]; none for an hf:// file)."""

    if h.file:
        return FileSpec(repo=h.repo, file=h.file, revision=h.revision)
    f = pick(list_files(h.repo, h.revision), h.repo, h.quant)
    return FileSpec(repo=h.repo, file=f.path, revision=f.revision or h.revision, size=f.size)


def file_spec(s: str, ollama=None):
    """One file for `models add`: a local path, `ollama:NAME[:TAG]` (the blob in Ollama's store it names now, read
    where it lies, as -m reads it: `ollama(s)` gives it, models/local.ollama_file, passed in by the caller since
    local reads this module), or a hub name (OWNER/REPO[:QUANT] is picked from the listing now, so the pair stores
    a definite file)."""
    p = user_path(s)
    if not is_file(p, s) and ollama is not None:
        p = ollama(s) or p
    if is_file(p, s):
        check_gguf_file(p, s)
        return FileSpec(path=str(p.resolve()))
    h = parse(s)
    return resolve(h) if h is not None else FileSpec.parse(s)


def cached_spec(h: HubName):
    """The downloaded file a hub name stands for, from the cache alone (no network), for `models rm`."""
    from localspec.models import download

    if h.file:
        spec = FileSpec(repo=h.repo, file=h.file, revision=h.revision)
    else:
        files = cached_files(h.repo, h.revision)
        if not any(_is_model_gguf(f.path) for f in files):
            raise UsageError(f"no GGUF of {h.repo} is downloaded")
        try:
            f = pick(files, h.repo, h.quant)
        except UsageError:
            raise UsageError(f"{h} is not downloaded; downloaded: "
                             + ", ".join(f"{h.repo}:{q}" for q in available(files))) from None
        spec = FileSpec(repo=h.repo, file=f.path, revision=f.revision or h.revision)
    if download.local_path(spec) is None:
        raise UsageError(f"{h} is not downloaded")
    return spec


def cached_models() -> list[tuple[str, object]]:
    """The GGUF models in the local HF cache, as (the name -m takes, FileSpec): `models list` shows those that
    no pair names, `models rm NAME` deletes them."""
    from localspec.models.download import hf_cache

    out = []
    for d in sorted(Path(hf_cache()).glob("models--*--*")):
        repo = d.name[len("models--"):].replace("--", "/", 1)
        files = cached_files(repo)
        for f in files:
            if not _is_model_gguf(f.path):
                continue
            q = quant_of(f.path)
            try:
                short = q is not None and f.revision is None and pick(files, repo, q).path == f.path
            except UsageError:
                short = False
            try:
                spec = FileSpec(repo=repo, file=f.path, revision=f.revision, size=f.size)
            except UsageError:
                continue  # a cache folder no hub name can reach (made by hand): not ours to list or delete
            name = f"{repo}:{q}" if short else str(HubName(repo, file=f.path, revision=f.revision))
            out.append((name, spec))
    return out
