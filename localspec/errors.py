"""Domain errors. Each front end turns these into its own shape: the CLI one `error:` line and an exit code, the
server an HTTP error body, the chat a line in the transcript.

An error about a setting names the setting, not a flag: `SettingError("draft tokens ({draft_tokens}) must be ...",
"draft_tokens")` reads "draft tokens (draft_tokens) must be ..." by default, and each front end words the setting
its own way with `worded()` (the CLI "-k", the server the JSON field "k")."""

from __future__ import annotations

from typing import Callable, Sequence


class LocalspecError(Exception):
    """Base class: a problem the user can act on. Message is one line. `settings`: the settings it concerns, each
    a `{name}` placeholder in the message."""

    exit_code = 1

    def __init__(self, message: str = "", settings: str | Sequence[str] = ()) -> None:
        self.settings = (settings,) if isinstance(settings, str) else tuple(settings)
        self.template = message
        super().__init__(self.worded() if self.settings else message)

    def worded(self, words: Callable[[str], str] | dict[str, str] | None = None) -> str:
        """The message with each setting named by `words` (a function or a dict; default: the setting's name)."""
        if not self.settings:
            return str(self)
        if isinstance(words, dict):
            table = words
            words = lambda s: table.get(s, s)  # noqa: E731
        words = words or (lambda s: s)
        out = self.template
        for s in self.settings:  # plain replacement: values quoted in the message may hold braces
            out = out.replace("{" + s + "}", words(s))
        return out


class UsageError(LocalspecError):
    exit_code = 2


class SettingError(UsageError):
    """A setting's value is out of range or of the wrong kind (see the module doc)."""


class ModelLoadError(LocalspecError):
    pass


class IncompatibleDraftError(LocalspecError):
    pass


class ContextOverflowError(LocalspecError):
    pass


class DecodeError(LocalspecError):
    pass


class DownloadError(LocalspecError):
    pass


class AlgorithmBugError(LocalspecError):
    """`localspec bench` found outputs that differ from plain decoding by more than float order can explain."""

    exit_code = 3


class DecodeCancelled(Exception):
    """A decode stopped between chunks because its request was cancelled (llama/model.py's Model.cancel_event): not
    an error, the request ends "cancelled"."""
