"""Tables that read well anywhere: a rich table on a terminal, plain aligned columns (nothing cut, no markup,
no box drawing) when the output goes to a pipe or a file."""

from __future__ import annotations

import sys
from typing import Sequence, TextIO


def _plain(text: str) -> str:
    from rich.text import Text

    return Text.from_markup(text).plain if "[" in text else text


def print_table(columns: Sequence[str], rows: Sequence[Sequence[str]], *, title: str | None = None,
                file: TextIO | None = None, right: Sequence[str] = ()) -> None:
    """Cells may carry rich markup and newlines; `right` names the right-aligned columns."""
    out = file or sys.stdout
    if out.isatty():
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title, title_justify="left")
        for c in columns:
            t.add_column(c, justify="right" if c in right else "left", overflow="fold")
        for r in rows:
            t.add_row(*r)
        Console(file=out).print(t)
        return
    # plain: one line per row (a cell's lines joined with " | "), columns padded to their widest cell
    cells = [[_plain(str(c)).replace("\n", " | ") for c in r] for r in rows]
    widths = [max([len(columns[i])] + [len(r[i]) for r in cells]) for i in range(len(columns))]

    def line(vals) -> str:
        parts = [v.rjust(w) if columns[i] in right else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths))]
        return "  ".join(parts).rstrip()

    if title:
        out.write(title + "\n")
    out.write(line(columns) + "\n")
    for r in cells:
        out.write(line(r) + "\n")
    out.flush()
