"""The prompt box: Enter sends, Shift+Enter or Ctrl+J inserts a newline, Up on the first line recalls earlier
prompts (the cursor goes to the end of the recalled one, ready to edit)."""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import TextArea


class PromptBox(TextArea):
    class Submitted(Message):
        def __init__(self, text: str) -> None:
            self.text = text
            super().__init__()

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("placeholder", "Ask something · Enter sends · Shift+Enter new line · / for commands")
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.prompt_history: list[str] = []
        self._hist_pos: int | None = None

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text.strip()
            if text:
                if not self.prompt_history or self.prompt_history[-1] != text:
                    self.prompt_history.append(text)
                self._hist_pos = None
                self.clear()
                self.post_message(self.Submitted(text))
            return
        if event.key in ("shift+enter", "ctrl+j", "newline"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        if event.key == "up" and self.cursor_location[0] == 0 and self.prompt_history:
            event.stop()
            event.prevent_default()
            pos = len(self.prompt_history) if self._hist_pos is None else self._hist_pos
            self._hist_pos = max(0, pos - 1)
            self.recall(self.prompt_history[self._hist_pos])
            return
        if event.key == "down" and self._hist_pos is not None and self.cursor_location[0] == self.document.line_count - 1:
            event.stop()
            event.prevent_default()
            self._hist_pos += 1
            if self._hist_pos >= len(self.prompt_history):
                self._hist_pos = None
                self.clear()
            else:
                self.recall(self.prompt_history[self._hist_pos])
            return
        await super()._on_key(event)

    def recall(self, text: str) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end)
