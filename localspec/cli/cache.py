"""`localspec cache`: the suffix drafter's cache of earlier prompts and answers, shown and cleared."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

cache_app = typer.Typer(help="The suffix cache of earlier prompts and answers: show its size, clear it.",
                        no_args_is_help=True)


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
        rows.append({"file": str(path), "documents": docs, "tokens": tokens, "bytes": size})
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

    print_table(["file", "documents", "tokens", "size"],
                [[r["file"], str(r["documents"]), str(r["tokens"]), _size(r["bytes"])] for r in rows],
                right=["documents", "tokens", "size"])
    sys.stderr.write(f"total: {total['documents']} documents, {total['tokens']} tokens, {_size(total['bytes'])}\n")


@cache_app.command("clear")
def cache_clear():
    """Delete the suffix cache (every vocabulary's and scope's). Running processes keep what they hold in memory."""
    from localspec.store import suffixcache as SC

    try:
        n = SC.clear()
    except OSError as exc:
        from localspec.errors import UsageError

        raise UsageError(f"cannot clear the suffix cache in {SC.folder()}: {exc.strerror or exc}") from None
    sys.stderr.write(f"cleared the suffix cache ({n} file{'s' if n != 1 else ''})\n")
