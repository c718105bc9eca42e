"""Text assembly for streaming: whole UTF-8 characters only, and text that might start a stop string held back."""

from __future__ import annotations

import codecs
from typing import Sequence


class TextAssembler:
    """Bytes in, text out: whole UTF-8 characters only, and text that might start a stop string is held
    back until it is known not to."""

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self._pending = ""
        self._stops = [s for s in stops if s]
        self.text = ""  # everything released so far

    def push(self, data: bytes) -> tuple[str, bool]:
        self._pending += self._dec.decode(data)
        if self._stops:
            hits = [i for i in (self._pending.find(s) for s in self._stops) if i >= 0]
            if hits:
                out = self._pending[: min(hits)]
                self._pending = ""
                self.text += out
                return out, True
            hold = 0
            for s in self._stops:
                for n in range(min(len(s) - 1, len(self._pending)), hold, -1):
                    if self._pending.endswith(s[:n]):
                        hold = n
                        break
            out = self._pending[: len(self._pending) - hold]
            self._pending = self._pending[len(self._pending) - hold :]
        else:
            out, self._pending = self._pending, ""
        self.text += out
        return out, False

    def held(self) -> str:
        """The text held back, without releasing it: a possible stop string's start, and a character cut short
        (as U+FFFD, the way flush() would end it)."""
        buffered, _ = self._dec.getstate()
        return self._pending + (buffered.decode("utf-8", "replace") if buffered else "")

    def flush(self) -> str:
        out = self._pending + self._dec.decode(b"", final=True)
        self._pending = ""
        self.text += out
        return out
