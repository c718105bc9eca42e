"""A yes/no question whose safe answer is the default."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label


class ConfirmScreen(ModalScreen[bool]):
    """A yes/no question whose safe answer is the default: No has the focus and Esc answers No. Keys typed while
    it is open (the user already typing the next prompt) are kept in `typed`, for the prompt box."""

    BINDINGS = [Binding("escape", "answer_no", "No", priority=True)]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question
        self.typed = ""

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm"):
            yield Label(self.question)
            with Horizontal():
                yield Button("Yes", id="yes", variant="error")
                yield Button("No", id="no", variant="primary")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_key(self, event) -> None:
        if event.is_printable and event.character:
            self.typed += event.character
            event.stop()
            event.prevent_default()

    def action_answer_no(self) -> None:
        self.dismiss(False)

    @on(Button.Pressed)
    def done(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")
