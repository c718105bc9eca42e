"""One line at the top: pair, method, k, temperature and backend (cut with an ellipsis, never wrapped)."""

from __future__ import annotations

from textual.widgets import Static


class HeaderBar(Static):
    def show(self, pair: str, method: str, k: int, temperature: float, backend: str, colors: bool) -> None:
        from rich.markup import escape

        self.update(  # the pair's name is a file name: text, not markup
            f" localspec │ {escape(pair)} │ method {method} │ k {k} │ temp {temperature:g} │ {backend} │ "
            f"colours in finished answers {'on' if colors else 'off'} (F2)"
        )
