"""`localspec history`: stored chats, listed, shown, exported and deleted."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from localspec.errors import UsageError

history_app = typer.Typer(help="Stored chats: list, show, export and delete them.", no_args_is_help=True)

def chat_id_in_range(value: int | None) -> int | None:
    """A chat number SQLite can hold (beyond 64 bits there is no such chat, and sqlite3 raises OverflowError)."""
    if value is not None and not -2**63 <= value < 2**63:
        raise UsageError(f"no chat {value} in the history (`localspec history list` shows them)")
    return value


ChatIdArg = Annotated[int, typer.Argument(help="Chat number (`localspec history list`).", show_default=False,
                                          callback=chat_id_in_range)]


def _history(create: bool = False):
    """The history database; without `create`, an absent one reads as empty (nothing is written)."""
    from localspec.store.history import History, db_path

    if not create and not db_path().exists():
        return History(":memory:")
    return History()


def _ask(question: str, what: str) -> bool:
    """Yes/no on a terminal, No by default; without a terminal there is nobody to ask: refuse."""
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        raise UsageError(f"{question} (no terminal to ask on: {what})")
    return typer.confirm(question, default=False, err=True)


@history_app.command("list")
def history_list(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    limit: Annotated[Optional[int], typer.Option("-n", "--limit", help="At most N chats (newest first).", show_default=False)] = None,
):
    """Stored chats, newest first."""
    store = _history()
    chats = store.chats(limit=limit)
    if as_json:
        typer.echo(json.dumps([{k: v for k, v in c.to_dict().items() if k != "messages"} | {"messages": c.n_messages}
                               for c in chats], indent=1, ensure_ascii=False))
        return
    if not chats:
        sys.stderr.write("no stored chats yet (`localspec chat` stores them as they happen)\n")
        return
    from rich.markup import escape

    from localspec.cli.table import print_table

    rows = [[str(c.id), time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated)), str(c.n_messages),
             escape(c.title), escape(c.model or "-")] for c in chats]
    print_table(["id", "updated", "messages", "title", "model"], rows, right=["id", "messages"])


@history_app.command("show")
def history_show(chat_id: ChatIdArg):
    """Print a stored chat as Markdown."""
    from localspec.store.exports import to_markdown

    c = _history().get(chat_id)
    typer.echo(to_markdown(c.title, c.messages, c.model), nl=False)


@history_app.command("export")
def history_export(
    chat_id: ChatIdArg,
    fmt: Annotated[str, typer.Option("--format", "-f", help="md or json.")] = "md",
    out: Annotated[Optional[Path], typer.Option("-o", "--output", help="Write to FILE (asks before overwriting); default: stdout.", show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite FILE without asking.")] = False,
):
    """Export a stored chat as Markdown or JSON."""
    from localspec.store.cachefile import atomic_write
    from localspec.store.exports import to_json, to_markdown

    if fmt not in ("md", "json"):
        raise UsageError(f"--format takes md or json, got {fmt!r}")
    c = _history().get(chat_id)
    text = to_json(c.to_dict()) if fmt == "json" else to_markdown(c.title, c.messages, c.model)
    if out is None:
        typer.echo(text, nl=False)
        return
    if out.is_dir():
        raise UsageError(f"{out} is a directory")
    if out.exists() and not force and not _ask(f"{out} exists. Overwrite it?", "add --force to overwrite"):
        sys.stderr.write(f"{out} not overwritten\n")
        raise typer.Exit(1)
    try:
        atomic_write(out, text)
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror or exc}") from None
    sys.stderr.write(f"wrote {out}\n")


@history_app.command("rm")
def history_rm(
    chat_id: ChatIdArg,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Delete without asking.")] = False,
):
    """Delete a stored chat (asks first)."""
    store = _history()
    c = store.get(chat_id)
    if not yes and not _ask(f"Delete chat {c.id} “{c.title}” ({c.n_messages} messages)?", "add --yes to delete"):
        sys.stderr.write(f"chat {c.id} kept\n")
        raise typer.Exit(1)
    store.delete(c.id)
    sys.stderr.write(f"deleted chat {c.id}\n")

