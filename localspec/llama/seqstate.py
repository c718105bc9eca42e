"""Per-sequence recurrent-state bookkeeping of a MultiSeq (llama/multiseq.py): where each sequence's state really
is, its checkpoint, whether a recurrent-state plane can still be selected, and what rollbacks cost.

The rules are the single-sequence Model's (llama/model.py), kept per sequence: a checkpoint is the sequence's
recurrent state (`llama_state_seq_get_data_ext(ctx, buf, size, seq, PARTIAL_ONLY)`: for a hybrid, without its
attention cells) in a buffer of its own; a plane is selected at most once per decode, within the rows the
sequence had in the decode just made.
"""

from __future__ import annotations

import ctypes
import time
from typing import Iterable, Sequence

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
