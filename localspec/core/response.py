"""One handle on a generation for every caller (after simonw/llm's Response): iterate its Pieces as they come, then
read `finished` (the Finished: text, tokens, finish reason, stats), or the request's error, raised.

A `Response` is fed one of two ways, and reads the same either way:
- pulled: Engine.respond() wraps a batch of one's generator (core/batch.py, BatchEngine.events); iterating the response runs the decode;
- pushed: BatchEngine.submit() hands `push` to the batch as the request's sink; the thread that steps the batch
  feeds it, and `listen` passes each event on as it arrives (the server posts them to the client's stream).
Meanwhile `text` is the answer released so far and `stats` its live figures: what a front end shows or keeps when
the generation is interrupted.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterator

from localspec.core.generation import Finished, Piece


class Response:
    def __init__(self, source: Iterator | None = None, stats: Callable | None = None,
                 held: Callable[[], str] | None = None) -> None:
        """source: the generator that decodes (pulled); None: a scheduler pushes. stats: where the request's live
        Stats are read while it runs; held: where the text it holds back is read (see so_far)."""
        self._source = source
        self._live = stats
        self._held = held
        self._queue: deque = deque()
        self._listeners: list[Callable] = []
        self._parts: list[str] = []
        self.finished: Finished | None = None
        self.error: Exception | None = None

    @property
    def stats(self):
        """The request's Stats: live while it runs, final once it has finished (None before it starts)."""
        if self.finished is not None:
            return self.finished.stats
        return self._live() if self._live is not None else None

    # ------------------------------------------------------------ the scheduler's side
    def push(self, ev) -> None:
        """An event from the scheduler: a Piece, the Finished, or the request's error (an exception)."""
        self._note(ev)
        if self._listeners:
            for fn in self._listeners:
                fn(ev)
        else:
            self._queue.append(ev)

    def listen(self, fn: Callable) -> "Response":
        """Pass every event (those already pushed first) to fn(event) as it arrives."""
        while self._queue:
            fn(self._queue.popleft())
        self._listeners.append(fn)
        return self

    # ------------------------------------------------------------ the caller's side
    @property
    def text(self) -> str:
        """The answer released so far (all of it once finished)."""
        return self.finished.text if self.finished is not None else "".join(self._parts)

    @property
    def so_far(self) -> str:
        """Every token's text so far, with what is held back (a possible stop string's start, a character cut
        short): the answer a front end that did not stream keeps when the generation ends early."""
        if self.finished is not None:
            return self.finished.text
        return self.text + (self._held() if self._held is not None else "")

    @property
    def done(self) -> bool:
        return self.finished is not None or self.error is not None

    def events(self) -> Iterator:
        """Every event in order (Pieces, then the Finished); the request's error is raised, after the Pieces
        before it."""
        if self._source is not None:
            for ev in self._source:
                self._note(ev)
                yield ev
            self._source = None
        while self._queue:
            ev = self._queue.popleft()
            if isinstance(ev, Exception):
                raise ev
            yield ev

    def __iter__(self) -> Iterator[Piece]:
        for ev in self.events():
            if isinstance(ev, Piece):
                yield ev

    def result(self) -> Finished:
        """The Finished, running the generation to its end if it is pulled."""
        for _ in self.events():
            pass
        if self.error is not None:
            raise self.error
        if self.finished is None:
            raise RuntimeError("the generation has not finished")
        return self.finished

    def _note(self, ev) -> None:
        if isinstance(ev, Piece):
            self._parts.append(ev.text)
        elif isinstance(ev, Finished):
            self.finished = ev
        elif isinstance(ev, Exception):
            self.error = ev
