"""The scrolling transcript of messages."""

from __future__ import annotations

from textual.containers import VerticalScroll

from localspec.tui.widgets.message import MessageView


class Transcript(VerticalScroll):
    def add(self, role: str, text: str = "", show_colors: bool = True, body=None) -> MessageView:
        m = MessageView(role, text, show_colors=show_colors, body=body)
        self.mount(m)
        self.scroll_end(animate=False)
        return m

    def messages(self) -> list[MessageView]:
        return list(self.query(MessageView))

    def clear_all(self) -> None:
        for m in self.messages():
            m.remove()
