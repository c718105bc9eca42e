"""The few lines a chat opens with: the pair, what the green text means, and the keys that matter."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static

KEYS = ("Enter send · Shift+Enter new line · ↑ earlier prompts · Esc stop\n"
        "Ctrl+P or /help commands · F3 details · F4 stats panel · Ctrl+Q quit")


class Welcome(Static):
    def show(self, pair: str, target: str | None = None, draft: str | None = None, loading: bool = True) -> None:
        if loading:
            models = "loading the models …"
        elif draft:
            models = f"{target} answers; {draft} drafts ahead of it"
        else:
            models = f"{target} answers; no draft model: earlier text (prompt lookup) drafts ahead of it"
        self.update(Content.assemble(  # Content, not markup: a file name may hold brackets
            ("localspec chat", "bold"), f" · {pair}\n",
            (models + "\n", "dim"),
            "Text in ", ("green", "bold green"),
            " was drafted and the model accepted it: the same answer, fewer slow steps. "
            "A finished answer turns into formatted Markdown (F2 keeps the colours).\n",
            (KEYS, "dim"),
        ))
