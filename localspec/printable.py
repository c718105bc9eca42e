"""Text from files shown on a terminal. A leaf: every layer that prints what a model file or a file name says uses it."""

from __future__ import annotations

import unicodedata


def has_control(s: str) -> bool:
    return any(unicodedata.category(c) == "Cc" for c in s)


def printable(text) -> str:
    """`text` (any value, as a string) with each control character (C0 such as ESC and BEL, DEL, C1 such as CSI)
    replaced by a space. Every string read from a model file (general.name, the architecture, token text) or a file
    name is shown through this on a terminal: escapes there could set the window title or clear the screen."""
    text = str(text)
    return "".join(" " if unicodedata.category(c) == "Cc" else c for c in text) if has_control(text) else text
