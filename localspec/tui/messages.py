"""The messages the app's thread workers post to it (loading the models, streaming an answer, warming the KV
cache). A worker never touches a widget: it posts one of these and the app's handler does, on its own thread."""

from __future__ import annotations

from textual.message import Message


class Loaded(Message):
    """The engine for `name` is loaded (and its exactness probe has run)."""

    def __init__(self, engine, name: str) -> None:
        self.engine, self.name = engine, name
        super().__init__()


class LoadFailed(Message):
    def __init__(self, error: str) -> None:
        self.error = error
        super().__init__()


class Token(Message):
    """A piece of the answer streaming into `view` (`drafted`: it came from an accepted draft token)."""

    def __init__(self, view, text: str, drafted: bool, stats) -> None:
        self.view, self.text, self.drafted, self.stats = view, text, drafted, stats
        super().__init__()


class Done(Message):
    """The answer in `view` is finished; `compare_with`: the (result, config) a /compare rerun is measured against."""

    def __init__(self, view, result, compare_with=None, cfg=None) -> None:
        self.view, self.result, self.compare_with, self.cfg = view, result, compare_with, cfg
        super().__init__()


class Failed(Message):
    def __init__(self, view, error: str) -> None:
        self.view, self.error = view, error
        super().__init__()


class Notice(Message):
    def __init__(self, text: str) -> None:
        self.text = text
        super().__init__()


class Warmed(Message):
    """A reopened chat's prompt (`tokens` of it) is in the KV cache."""

    def __init__(self, chat_id, tokens: int) -> None:
        self.chat_id, self.tokens = chat_id, tokens
        super().__init__()
