"""One chat message. An assistant answer streams as text whose accepted draft tokens are coloured
differently from tokens the target produced itself; once finished it renders as Markdown."""

from __future__ import annotations

from rich.text import Text
from textual.containers import Vertical
from textual.widgets import Markdown, Static

DRAFT_STYLE = "bold green"
TARGET_STYLE = ""


class MessageView(Vertical):
    def __init__(self, role: str, text: str = "", show_colors: bool = True, body=None, **kwargs) -> None:
        super().__init__(classes=f"message {role}", **kwargs)
        self.role = role
        self.text = text
        self.body = body  # a Rich renderable shown instead of `text` (e.g. /help's table); `text` stays the words
        self.spans: list[tuple[str, bool]] = []  # (text, came from an accepted draft token)
        self.finished = role != "assistant"
        self.note = ""
        self.show_colors = show_colors

    def compose(self):
        yield Static(self.role, classes="role")
        if self.role == "assistant":
            yield Static(self._rich(), classes="body stream")
            yield Markdown("", classes="body final")
        else:
            yield Static(self.body if self.body is not None else Text(self.text), classes="body")
        yield Static("", classes="note")

    def on_mount(self) -> None:
        self.refresh_view()  # state may have changed before the children were mounted

    def _rich(self) -> Text:
        t = Text()
        for piece, drafted in self.spans:
            t.append(piece, style=DRAFT_STYLE if (drafted and (self.show_colors or not self.finished)) else TARGET_STYLE)
        return t

    def append(self, piece: str, drafted: bool) -> None:
        if not piece:
            return
        self.text += piece
        if self.spans and self.spans[-1][1] == drafted:
            self.spans[-1] = (self.spans[-1][0] + piece, drafted)
        else:
            self.spans.append((piece, drafted))

    def flush(self) -> None:
        """Show what was appended (the app calls this at most every 0.1 s: rendering costs CPU the model needs)."""
        if self.children:
            self.query_one(".stream", Static).update(self._rich())

    def finish(self, note: str = "") -> None:
        self.finished = True
        self.note = note
        self.refresh_view()

    def refresh_view(self) -> None:
        if not self.children:  # not composed yet: on_mount calls this again (is_mounted is still False there)
            return
        self.query_one(".note", Static).update(Text(self.note, style="dim"))
        if self.role != "assistant":
            return
        stream = self.query_one(".stream", Static)
        final = self.query_one(".final", Markdown)
        if self.finished and not self.show_colors:
            if final.source != self.text:
                final.update(self.text)
            final.display = True
            stream.display = False
        else:
            stream.update(self._rich())
            stream.display = True
            final.display = False

    def set_colors(self, on: bool) -> None:
        self.show_colors = on
        self.refresh_view()
