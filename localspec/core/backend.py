"""The sequences the scheduler (core/batch.py) decodes its requests' rows in, and what it asks of the Engine.

`SeqBackend` is what a step reads and does on its sequences: how many there are and what each holds (`tokens`), one
decode of rows of several of them, a sequence cut back (the rejected drafts; a recurrent state by `rollback_kind`), the
replays such a cut leaves (`pending`, `flush`), checkpoints, and what rollbacks cost (`rollback_counters`). Two
implementations:
- `OwnContext`: the target's own single-sequence context (llama/model.py's Model) as one sequence, what `run`,
  `chat`, `bench` and `serve --parallel 1` decode in. Every decode is handed to the Engine's drafters (draft heads
  read the target's hidden states there); a recurrent state's rollback replays at once, and those rows too go to
  the drafters, so nothing is left pending.
- llama/multiseq.py's MultiSeq: N sequences of a second context over the target's weights, decoded together; a
  rollback's replays are deferred to the next decode (`flush`), all sequences' in one.

`EngineSide` is all the scheduler uses of the Engine (core/engine.py): its public methods, typed here so the
scheduler never reaches the Engine's own state.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Protocol, Sequence

import numpy as np


class SeqBackend(Protocol):
    n_seq: int
    n_ctx: int  # per sequence
    n_batch: int
    unified: bool  # one KV cache for every sequence (a step is one pass)
    rollback_kind: str  # llama/model.py: "kv", "rs", "checkpoint" ("none" never shares a pass)
    cold_chunk: int

    @property
    def tokens(self) -> list[list[int]]:
        """What each sequence holds, position i = tokens[s][i] (a pending replay included)."""

    @property
    def recurrent(self) -> bool: ...

    def decode(self, parts: Sequence[tuple[int, Sequence[int], Sequence[int]]], copy: bool = True
               ) -> list[np.ndarray]:
        """One decode of (seq, tokens, rows wanted) parts; one logits array per part."""

    def truncate(self, seq: int, n_keep: int) -> None: ...

    def pending(self, seq: int) -> int:
        """Tokens of `seq` a rollback left to decode again (flush)."""

    def flush(self) -> int: ...

    def passes(self, counts: Sequence[tuple[int, int]]) -> list[list[tuple[int, int, int]]]:
        """The forward passes a decode of (seq, rows) counts runs as."""

    def save_checkpoint(self, seq: int) -> None: ...

    def rollback_counters(self, seq: int) -> dict: ...

    def clear(self, seq: int | None = None) -> None: ...

    def close(self) -> None: ...


class OwnContext:
    """A Model's own context as a SeqBackend of one sequence (sequence 0). `feed(tokens, start)`: what every decode
    of it, replays included, is handed to (the Engine's drafters; None: nothing). The Model is its owner's to
    close."""

    n_seq = 1
    unified = False
    cold_chunk = 0  # the prompt cache tracks the model's own cold prefix (Model.cold_upto)

    def __init__(self, model, feed: Callable[[Sequence[int], int], None] | None = None) -> None:
        self.model = model
        self.feed = feed

    @property
    def tokens(self) -> list[list[int]]:
        return [self.model.tokens]

    @property
    def n_ctx(self) -> int:
        return self.model.n_ctx

    @property
    def n_batch(self) -> int:
        return self.model.n_batch

    @property
    def rollback_kind(self) -> str:
        return self.model.rollback_kind

    @property
    def recurrent(self) -> bool:
        return self.model.rollback_kind != "kv"

    def decode(self, parts, copy: bool = True) -> list[np.ndarray]:
        ((_, toks, rows),) = parts
        base = len(self.model.tokens)
        out = self.model.decode(toks, list(rows), copy=copy)
        self._fed(toks, base)
        return [out]

    def truncate(self, seq: int, n_keep: int) -> None:
        replay = self.model.truncate(n_keep)  # recurrent/hybrid: may decode accepted tokens again
        if replay:
            self._fed(replay, self.model.last_replay[1])

    def pending(self, seq: int) -> int:
        return 0

    def flush(self) -> int:
        return 0

    def passes(self, counts):
        return [[(int(s), 0, int(n)) for s, n in counts if n > 0]]

    def save_checkpoint(self, seq: int) -> None:
        self.model.save_checkpoint()

    def rollback_counters(self, seq: int) -> dict:
        return self.model.rollback_counters()

    def clear(self, seq: int | None = None) -> None:
        self.model.clear()

    def close(self) -> None:
        """Nothing of its own."""

    def _fed(self, tokens: Sequence[int], start: int) -> None:
        if self.feed is not None:
            self.feed(tokens, start)


class EngineSide(Protocol):
    """What the scheduler asks of the Engine."""

    target: Any
    draft: Any
    draft_kind: str | None
    heads: dict
    suffix_scope: str
    prompt_cache: Any
    controller_state: dict | None

    def resolve_method(self, cfg) -> str: ...

    def exactness_for(self, cfg, cancel: threading.Event | None = None, rows: int | None = None
                      ) -> tuple[int, str, str]: ...

    def exact_k(self, k: int, cancel: threading.Event | None = None) -> int: ...

    def make_policy(self, cfg, exactness: tuple[int, str, str] | None = None) -> tuple[Any, str, int]: ...

    def verify_costs(self, upto: int) -> dict[int, float] | None: ...

    def note_verify_steps(self, policy) -> None: ...

    def rollback_notice(self, cfg) -> str: ...

    def sync_prompt(self, prompt: Sequence[int], copy: bool = True,
                    shared_upto: int = 0) -> tuple[np.ndarray, int, str]: ...

    def restore_draft_state(self, prompt: Sequence[int]) -> None: ...

    def save_draft_state(self, prompt: Sequence[int], fill: bool = False, shared_upto: int = 0) -> None: ...

    def attach(self, drafters: Iterable, text, stats) -> None: ...

    def after_target_decode(self, tokens: Sequence[int], start: int) -> None: ...
