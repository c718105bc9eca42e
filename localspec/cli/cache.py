"""`localspec cache`: the suffix drafter's cache of earlier prompts and answers and the prompt states (the KV state of
long prompts' prefixes, core/prompt_cache.py), shown and cleared, and a static suffix cache built from a folder of text
or code."""

from __future__ import annotations

import fnmatch
import json
import os
import stat
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from localspec.cli.options import ModelOpt, flags

cache_app = typer.Typer(help="The suffix cache of earlier prompts and answers and the prompt states: show their size, "
                             "clear them, build a static suffix cache from a folder.", no_args_is_help=True)
MAX_FILE_BYTES = 4 << 20  # a larger file is data, not text to draft from


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _shown(text) -> str:
    """A path as printed on a terminal: control characters (escape sequences) replaced, rich markup kept as text."""
    from rich.markup import escape

    from localspec.printable import printable

    return escape(printable(text))


@cache_app.command("show")
def cache_show(as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False):
    """Where the suffix cache lives, its files, documents, tokens and size on disk, and its settings; the prompt
    states kept on disk (how many, their size, for which models)."""
    from localspec import settings as config
    from localspec.store import suffixcache as SC
    from localspec.store.prompt_states import PromptStates

    from localspec.printable import printable

    v = config.values()
    try:
        found = SC.files()
    except OSError as exc:
        from localspec.errors import LocalspecError

        why = exc.strerror or exc
        raise LocalspecError(printable(f"cannot read the suffix cache in {SC.folder()}: {why}")) from None
    rows = [{"file": str(path), "kind": "static" if SC.is_static(path) else "dynamic", "documents": docs,
             "tokens": tokens, "bytes": size} for path, docs, tokens, size in found]
    total = {"documents": sum(r["documents"] for r in rows), "tokens": sum(r["tokens"] for r in rows),
             "bytes": sum(r["bytes"] for r in rows)}
    states = PromptStates(budget=v["prompt_cache_bytes"]).summary()
    states["on"] = v["prompt_cache"]
    if as_json:
        typer.echo(json.dumps({"folder": str(SC.folder()), "persist": v["suffix_cache"],
                               "max_tokens": v["suffix_cache_tokens"], "files": rows, "total": total,
                               "prompt_states": states}, indent=1))
        return
    _show_states(states)
    state = "on" if v["suffix_cache"] else "off (suffix_cache = false: kept within a process only)"
    sys.stderr.write(printable(f"suffix cache in {SC.folder()}: persistence {state}, at most "
                               f"{v['suffix_cache_tokens']} tokens per vocabulary") + "\n")
    note = SC.folder_note()
    if note:
        sys.stderr.write(printable(f"note: {note}") + "\n")
    if not rows:
        sys.stderr.write("empty\n")
        return
    from localspec.cli.table import print_table

    print_table(["file", "kind", "documents", "tokens", "size"],
                [[_shown(r["file"]), r["kind"], str(r["documents"]), str(r["tokens"]), _size(r["bytes"])]
                 for r in rows],
                right=["documents", "tokens", "size"])
    sys.stderr.write(f"total: {total['documents']} documents, {total['tokens']} tokens, {_size(total['bytes'])}\n")


def _show_states(s: dict) -> None:
    from localspec.printable import printable

    state = "on" if s["on"] else "off (prompt_cache = false)"
    line = f"prompt states in {s['folder']}: {state}, at most {_size(s['budget'])}; "
    if not s["count"]:
        line += "none"
    else:
        models = ", ".join(f"{name} ({n})" for name, n in sorted(s["models"].items()))
        line += f"{s['count']} state{'s' if s['count'] != 1 else ''}, {_size(s['bytes'])}: {models}"
    sys.stderr.write(printable(line) + "\n")


@cache_app.command("clear")
def cache_clear(
    prompt_states: Annotated[bool, typer.Option("--prompt-states", help="Only the prompt states (the suffix cache "
                                                "is kept).")] = False,
):
    """Delete the suffix cache (every vocabulary's and scope's, static ones too) and the prompt states: localspec's own
    files in its cache folder, nothing else. Running processes keep what they hold in memory."""
    from localspec.errors import UsageError
    from localspec.printable import printable
    from localspec.store import suffixcache as SC
    from localspec.store.prompt_states import PromptStates

    states = PromptStates()
    try:
        k = states.clear()
    except OSError as exc:
        raise UsageError(printable(f"cannot clear the prompt states in {states.folder}: {exc.strerror or exc}")) from None
    cleared_states = f"the prompt states ({k} file{'s' if k != 1 else ''})"
    if prompt_states:
        sys.stderr.write(f"cleared {cleared_states}\n")
        return
    try:
        n = SC.clear()
    except OSError as exc:
        raise UsageError(printable(f"cannot clear the suffix cache in {SC.folder()}: {exc.strerror or exc}")) from None
    note = SC.folder_note()
    if note:
        sys.stderr.write(printable(f"note: {note}") + "\n")
    sys.stderr.write(f"cleared the suffix cache ({n} file{'s' if n != 1 else ''}) and {cleared_states}\n")


def _glob_parts(pattern: str) -> list[str]:
    return [p for p in pattern.replace(os.sep, "/").split("/") if p not in ("", ".")]


def _matches(parts: list[str], pattern: list[str]) -> bool:
    """Whether a relative path (its names) matches a glob pattern (its parts) as Path.glob reads one: `*`, `?` and
    `[...]` within one name, `**` any number of folders (at the end: every file below)."""

    def closure(states: set[int]) -> set[int]:
        out = set(states)
        for i in sorted(states):
            while i < len(pattern) and pattern[i] == "**":
                i += 1
                out.add(i)
        return out

    states = closure({0})
    for name in parts:
        states = closure({i if pattern[i] == "**" else i + 1 for i in states
                          if i < len(pattern) and (pattern[i] == "**" or fnmatch.fnmatchcase(name, pattern[i]))})
        if not states:
            return False
    return len(pattern) in states


def text_files(root: Path, patterns: list[str]) -> list[tuple[str, float, str]]:
    """(path relative to root, modification time, text) of the files under `root` that match a glob pattern, in
    path order: UTF-8 text only (no NUL byte, at most MAX_FILE_BYTES), regular files only. No symbolic link is
    followed, to a file or a folder (it may lead out of `root`: a home folder, /proc), and nothing hidden is read, a
    file or a folder whose name starts with a dot (.git, .venv, .env: secrets and tools' state, not the text)."""
    from localspec.store.cachefile import open_folder, read_regular

    wanted = [_glob_parts(p) for p in patterns]
    found: list[tuple[str, float, str]] = []
    stack = [""]
    while stack:  # iterative: a deep tree costs no recursion
        rel_dir = stack.pop()
        folder = root / rel_dir if rel_dir else root
        try:
            with open_folder(folder, follow=not rel_dir) as dfd:
                with os.scandir(dfd if dfd is not None else folder) as it:
                    entries = list(it)
                for e in entries:
                    if e.name.startswith("."):
                        continue
                    rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
                    try:
                        mode = e.stat(follow_symlinks=False).st_mode
                    except OSError:
                        continue
                    if stat.S_ISDIR(mode):
                        stack.append(rel)
                        continue
                    if not stat.S_ISREG(mode) or not any(_matches(rel.split("/"), w) for w in wanted):
                        continue  # a link, a pipe, a device: never opened
                    try:
                        data, st = read_regular(folder, dfd, e.name, MAX_FILE_BYTES)
                        text = data.decode("utf-8")
                    except (OSError, UnicodeDecodeError):
                        continue
                    if "\0" not in text and text.strip():
                        found.append((rel, st.st_mtime, text))
        except OSError:
            if not rel_dir:
                raise
            # a sub-folder that cannot be read (no permission, a path too long, replaced by a link meanwhile) is
            # skipped as an unreadable file is
    return sorted(found)


@cache_app.command("build")
def cache_build(
    folder: Annotated[Path, typer.Argument(help="The folder of text or code to draft from (only read).",
                                           show_default=False)],
    model: ModelOpt = None,
    globs: Annotated[Optional[list[str]], typer.Option("--glob", help="Only files matching this pattern under the "
                     "folder, e.g. '**/*.py' (repeatable; default: every text file).", show_default=False)] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", help="Most tokens kept (the most recently "
                          "modified files first; default 250000, at most 4194304).", show_default=False)] = None,
):
    """Build the static suffix cache of the model's vocabulary from a folder's text and code files: the suffix drafter
    drafts from it where earlier prompts and answers match nothing. Replaces that vocabulary's static cache.

    Read: regular UTF-8 text files up to 4 MB. Skipped: hidden files and folders (a name starting with a dot: .git,
    .env) and symbolic links, to files or folders (never followed out of the folder)."""
    from localspec.errors import UsageError
    from localspec.models.spec import is_dir, shown, user_path
    from localspec.store import suffixcache as SC

    root = user_path(str(folder))  # a `~USER` that names no user, a name too long to look up: usage errors
    if not is_dir(root, folder):
        raise UsageError(f"cannot read folder {shown(folder)}: "
                         + ("not a folder" if os.path.exists(root) else "no such folder"))
    bound = SC.STATIC_TOKENS if max_tokens is None else max_tokens
    # every process that drafts reads the file back, up to a size bound: a larger one would be built, then skipped
    most = SC.MIN_READ_BYTES // SC.BYTES_PER_TOKEN
    if not 1 <= bound <= most:
        raise UsageError(f"--max-tokens must be between 1 and {most}, got {bound}")
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
    from localspec.drafters.suffix_corpus import Doc
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
