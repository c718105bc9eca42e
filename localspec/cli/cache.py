"""`localspec cache`: the suffix drafter's cache of earlier prompts and answers, shown and cleared, and a static cache
built from a folder of text or code."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from localspec.cli.options import ModelOpt, flags

cache_app = typer.Typer(help="The suffix cache of earlier prompts and answers: show its size, clear it, build a "
                             "static one from a folder.", no_args_is_help=True)
MAX_FILE_BYTES = 4 << 20  # a larger file is data, not text to draft from


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


@cache_app.command("show")
def cache_show(as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False):
    """Where the suffix cache lives, its files, documents, tokens and size on disk, and its settings."""
    from localspec import settings as config
    from localspec.store import suffixcache as SC

    v = config.values()
    rows = []
    for path, docs, tokens in SC.files():
        try:
            size = path.stat().st_size
        except OSError:
            size = 0
        rows.append({"file": str(path), "kind": "static" if SC.is_static(path) else "dynamic", "documents": docs,
                     "tokens": tokens, "bytes": size})
    total = {"documents": sum(r["documents"] for r in rows), "tokens": sum(r["tokens"] for r in rows),
             "bytes": sum(r["bytes"] for r in rows)}
    if as_json:
        typer.echo(json.dumps({"folder": str(SC.folder()), "persist": v["suffix_cache"],
                               "max_tokens": v["suffix_cache_tokens"], "files": rows, "total": total}, indent=1))
        return
    state = "on" if v["suffix_cache"] else "off (suffix_cache = false: kept within a process only)"
    sys.stderr.write(f"suffix cache in {SC.folder()}: persistence {state}, at most {v['suffix_cache_tokens']} tokens "
                     "per vocabulary\n")
    if not rows:
        sys.stderr.write("empty\n")
        return
    from localspec.cli.table import print_table

    print_table(["file", "kind", "documents", "tokens", "size"],
                [[r["file"], r["kind"], str(r["documents"]), str(r["tokens"]), _size(r["bytes"])] for r in rows],
                right=["documents", "tokens", "size"])
    sys.stderr.write(f"total: {total['documents']} documents, {total['tokens']} tokens, {_size(total['bytes'])}\n")


@cache_app.command("clear")
def cache_clear():
    """Delete the suffix cache (every vocabulary's and scope's, static ones too). Running processes keep what they
    hold in memory."""
    from localspec.store import suffixcache as SC

    try:
        n = SC.clear()
    except OSError as exc:
        from localspec.errors import UsageError

        raise UsageError(f"cannot clear the suffix cache in {SC.folder()}: {exc.strerror or exc}") from None
    sys.stderr.write(f"cleared the suffix cache ({n} file{'s' if n != 1 else ''})\n")


def text_files(root: Path, patterns: list[str]) -> list[tuple[str, float, str]]:
    """(path relative to root, modification time, text) of the files under `root` that match a glob pattern, in
    path order: UTF-8 text only (no NUL byte, at most MAX_FILE_BYTES), nothing under a hidden folder (.git, .venv)."""
    seen: dict[str, tuple[float, str]] = {}
    for pattern in patterns:
        for p in root.glob(pattern):
            rel = p.relative_to(root)
            if rel.as_posix() in seen or any(part.startswith(".") for part in rel.parts[:-1]):
                continue
            try:
                if not p.is_file() or p.stat().st_size > MAX_FILE_BYTES:
                    continue
                data = p.read_bytes()
                text = data.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if "\0" not in text and text.strip():
                seen[rel.as_posix()] = (p.stat().st_mtime, text)
    return [(rel, t, text) for rel, (t, text) in sorted(seen.items())]


@cache_app.command("build")
def cache_build(
    folder: Annotated[Path, typer.Argument(help="The folder of text or code to draft from (only read).",
                                           show_default=False)],
    model: ModelOpt = None,
    globs: Annotated[Optional[list[str]], typer.Option("--glob", help="Only files matching this pattern under the "
                     "folder, e.g. '**/*.py' (repeatable; default: every text file).", show_default=False)] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", help="Most tokens kept (the most recently "
                          "modified files first; default 250000).", show_default=False)] = None,
):
    """Build the static suffix cache of the model's vocabulary from a folder's text and code files: the suffix drafter
    drafts from it where earlier prompts and answers match nothing. Replaces that vocabulary's static cache."""
    from localspec.errors import UsageError
    from localspec.store import suffixcache as SC

    root = folder.expanduser()
    if not root.is_dir():
        raise UsageError(f"cannot read folder {folder}: " + ("not a folder" if root.exists() else "no such folder"))
    bound = SC.STATIC_TOKENS if max_tokens is None else max_tokens
    if bound < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {bound}")
    patterns = globs or ["**/*"]
    for pattern in patterns:
        if not pattern or Path(pattern).is_absolute() or ".." in Path(pattern).parts:
            raise UsageError(f"--glob {pattern!r}: a pattern relative to the folder expected, e.g. '**/*.py'")
    try:
        root.stat()
        found = text_files(root, patterns)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read folder {folder}: {getattr(exc, 'strerror', None) or exc}") from None
    if not found:
        raise UsageError(f"no text files in {folder}" + (f" match {', '.join(patterns)}" if globs else ""))
    from localspec.drafters.suffix import Doc
    from localspec.llama.model import Model
    from localspec.printable import printable
    from localspec.session import Session

    sess = Session(flags(model=model, method="none"), announce=lambda m: sys.stderr.write(m + "\n"))
    sess.check()
    target, _, _ = sess.resolve_models()
    with Model(target, n_ctx=256) as m:  # the vocabulary is what is used: the smallest context will do
        fp = SC.model_fingerprint(m)
        # a file's text is text: a control token's spelling in it stays plain characters
        docs = [Doc(rel, t, m.tokenize(text, add_special=False, parse_special=False)) for rel, t, text in found]
    docs = [d for d in docs if len(d.tokens) >= 2]
    kept = SC.bound(sorted(((d.id, (d.t, d.tokens)) for d in docs), key=lambda kv: kv[1][0]), bound)
    store = SC.SuffixFile(fp, max_tokens=bound, path=SC.static_path(fp), say=lambda msg: None)
    if not store.save([Doc(i, t, toks) for i, (t, toks) in kept], replace=True):
        raise UsageError(f"cannot write the static suffix cache {store.path}")
    n_tok = sum(len(toks) for _, (_, toks) in kept)
    left = len(docs) - len(kept)
    sys.stderr.write(printable(f"static suffix cache for {target.name}: {len(kept)} file{'s' if len(kept) != 1 else ''}, "
                               f"{n_tok} tokens in {store.path}")
                     + (f" ({left} older file{'s' if left != 1 else ''} over the bound of {bound} tokens left out)"
                        if left else "") + "\n")
