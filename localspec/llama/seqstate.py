"""Per-sequence recurrent-state bookkeeping of a context (llama/model.py's Model: its one sequence; llama/multiseq.py's
MultiSeq: each of its sequences): where each sequence's state really is, its checkpoint, whether a recurrent-state
plane can still be selected, and what rollbacks cost; and `roll_back`, the one rollback both contexts make.

The rules (llama/model.py's module docstring), kept per sequence: a checkpoint is the sequence's
recurrent state (`llama_state_seq_get_data_ext(ctx, buf, size, seq, PARTIAL_ONLY)`: for a hybrid, without its
attention cells) in a buffer of its own; a plane is selected at most once per decode, within the rows the
sequence had in the decode just made.
"""

from __future__ import annotations

import ctypes
import time
from typing import Iterable, Sequence

from localspec.errors import DecodeError
from localspec.llama.lib import ll as _ll


class SeqStates:
    """done[s]: tokens of sequence s really decoded in the context (its `tokens` beyond that are a pending replay);
    pos[s]: the position its checkpoint was saved at (None: no valid one)."""

    def __init__(self, ctx, n_seq: int) -> None:
        self._ctx = ctx
        self.n_seq = n_seq
        self.done = [0] * n_seq
        self.pos: list[int | None] = [None] * n_seq
        self._buf: list = [None] * n_seq
        self._len = [0] * n_seq
        self._rows = [0] * n_seq  # rows the sequence had in the last decode (0: it was not in it)
        self._in_last = [False] * n_seq  # ... and whether they ran in that decode's last forward pass
        self._rolled = [False] * n_seq  # a plane was selected since
        self.restores = [0] * n_seq
        self.replayed = [0] * n_seq
        self.rs_rollbacks = [0] * n_seq
        self.nbytes = [0] * n_seq
        self.save_s = [0.0] * n_seq
        self.restore_s = [0.0] * n_seq

    def counters(self, seq: int) -> dict:
        """Model.rollback_counters' fields for one sequence."""
        return {"restores": self.restores[seq], "replayed_tokens": self.replayed[seq],
                "rs_rollbacks": self.rs_rollbacks[seq], "checkpoint_bytes": self.nbytes[seq],
                "save_s": self.save_s[seq], "restore_s": self.restore_s[seq]}

    # ------------------------------------------------------------ decodes
    def decoded(self, counts: Sequence[tuple[int, int]], last_pass: Iterable[int]) -> None:
        """A llama_decode of (seq, rows) ran; `last_pass`: the sequences of its last forward pass. A sequence not in
        it can no longer select a plane: the decode's passes gather their sequences' cells and write their planes,
        which may be where its planes were."""
        last = set(last_pass)
        self._rows = [0] * self.n_seq
        self._in_last = [False] * self.n_seq
        for seq, n in counts:
            self.done[seq] += n
            self._rows[seq] = n
            self._in_last[seq] = seq in last
            self._rolled[seq] = False

    def can_select(self, seq: int, drop: int, rs_seq: int) -> bool:
        """Whether dropping `drop` tail tokens of `seq` selects one of its planes: inside its rows of the last
        decode, keeping at least the first, at most rs_seq, once per decode, where no later pass can have moved its
        cell (llama.cpp's seq_rm answers true past these limits too, and leaves a stale state)."""
        return (not self._rolled[seq] and self._in_last[seq] and 1 <= drop < self._rows[seq]
                and drop <= rs_seq)

    def selected(self, seq: int, n_keep: int) -> None:
        self._rolled[seq] = True
        self.rs_rollbacks[seq] += 1
        self.done[seq] = n_keep
        if self.pos[seq] is not None and self.pos[seq] > n_keep:
            self.pos[seq] = None

    # ------------------------------------------------------------ checkpoints
    def save(self, seq: int, pos: int) -> None:
        """Save `seq`'s recurrent state, decoded up to `pos` (done[seq] == pos), unless saved there already."""
        if self.pos[seq] == pos:
            return
        flags = _ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        t0 = time.perf_counter()
        need = int(_ll.llama_state_seq_get_size_ext(self._ctx, seq, flags))
        buf = self._buf[seq]
        if buf is None or len(buf) < need:
            buf = self._buf[seq] = (ctypes.c_uint8 * need)()
        n = int(_ll.llama_state_seq_get_data_ext(self._ctx, buf, len(buf), seq, flags))
        self.save_s[seq] += time.perf_counter() - t0
        if n <= 0:
            self.pos[seq] = None
            return
        self._len[seq] = n
        self.pos[seq] = pos
        self.nbytes[seq] = n

    def restore(self, seq: int, n_keep: int, mem) -> bool:
        """Put `seq` back to its checkpoint, where that is at or before n_keep, and remove its attention cells from
        there. False: no usable checkpoint, or llama.cpp could not restore it (the caller clears the sequence)."""
        pos = self.pos[seq]
        if pos is None or pos > n_keep:
            return False
        t0 = time.perf_counter()
        n = int(_ll.llama_state_seq_set_data_ext(self._ctx, self._buf[seq], self._len[seq], seq,
                                                 _ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY))
        ok = n > 0 and bool(_ll.llama_memory_seq_rm(mem, seq, pos, -1))
        self.restore_s[seq] += time.perf_counter() - t0
        if not ok:
            return False
        self.restores[seq] += 1
        self.done[seq] = pos
        self._rows[seq] = 0
        self._rolled[seq] = False
        return True

    def cleared(self, seq: int, restore: bool = False) -> None:
        """`seq` holds nothing now; restore: as a rollback without a usable checkpoint (counted as a restore, the
        whole kept context to replay)."""
        self.done[seq] = 0
        self.pos[seq] = None
        self._rows[seq] = 0
        self._rolled[seq] = False
        if restore:
            self.restores[seq] += 1


def roll_back(states: SeqStates, mem, seq: int, n_keep: int, kind: str, rs_seq: int, name: str) -> None:
    """Cut sequence `seq` of a context (memory `mem`), decoded up to states.done[seq] (a recurrent state) or holding
    more than n_keep > 0 tokens (a KV cache), back to n_keep by the model's rollback kind: "kv" removes the cells;
    "rs" selects a plane where the last decode allows it (SeqStates.can_select); otherwise (and for "checkpoint" and
    "none") the sequence's checkpoint at or before n_keep is restored, or without one the sequence is cleared.
    Afterwards a recurrent sequence's state is at states.done[seq]: the tokens from there to n_keep are the replay
    the caller decodes again (at once, or with the next decode)."""
    if kind == "kv":
        if not _ll.llama_memory_seq_rm(mem, seq, n_keep, -1):
            raise DecodeError(f"{name}: llama.cpp cannot remove KV entries of sequence {seq} from position {n_keep}")
        return
    if n_keep == 0:
        _ll.llama_memory_seq_rm(mem, seq, -1, -1)
        states.cleared(seq)
        return
    if (kind == "rs" and states.can_select(seq, states.done[seq] - n_keep, rs_seq)
            and _ll.llama_memory_seq_rm(mem, seq, n_keep, -1)):
        states.selected(seq, n_keep)
    elif not states.restore(seq, n_keep, mem):  # no usable checkpoint: from the start
        _ll.llama_memory_seq_rm(mem, seq, -1, -1)
        states.cleared(seq, restore=True)
