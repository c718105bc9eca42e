"""Where a draft head reads the target's hidden states (layer inputs for EAGLE-3 and DFlash, the nextn/pre-norm state
for MTP): a context's last decode, whose buffers live only until that context's next decode.

- TargetTap: the target's own context (the single-sequence path). Model.decode splits a long prompt into n_batch
  chunks, and only the last chunk's rows are left.
- SeqTap: one sequence's rows of a MultiSeq decode (a batch slot). llama.cpp puts the layer-input and unmasked nextn
  rows of every ubatch back in the order the batch gave them (llama_context::output_reorder, embd_batch_idxs), and
  MultiSeq.decode gives each sequence's rows one run, so the slot's rows are a contiguous range of the buffer.

A head enables what it reads on the tap's context (enable_layer_inp, enable_nextn); the flags stay on for that
context's later decodes.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from localspec.errors import DecodeError
from localspec.llama import heads


class TargetTap:
    """The rows of the target context's last decode (the last n_batch chunk of a long one)."""

    def __init__(self, target) -> None:
        self._ctx = target.ctx_handle
        self.n_batch = int(target.n_batch)

    def enable_layer_inp(self, layer_ids: Sequence[int]) -> None:
        heads.enable_layer_inp(self._ctx, layer_ids)

    def enable_nextn(self) -> None:
        heads.set_nextn(self._ctx, True, False)  # unmasked: every row, whatever its logits flag

    def _span(self, n_tokens: int) -> tuple[int, int]:
        """(first buffer row, rows) of the last decode's n_tokens tokens that are still in the buffer."""
        return 0, (int(n_tokens) - 1) % self.n_batch + 1

    def layer_inp(self, layer_ids: Sequence[int], n_tokens: int, n_embd: int) -> np.ndarray:
        """The last decode's rows (its last chunk's) of the layers' inputs side by side: (m, len(layer_ids) * n_embd),
        a copy."""
        start, m = self._span(n_tokens)
        return np.concatenate([heads.layer_inp_rows(self._ctx, lid, start + m, n_embd)[start:] for lid in layer_ids],
                              axis=1)

    def nextn(self, n_tokens: int, n_embd: int) -> np.ndarray:
        """The last decode's nextn rows (its last chunk's): (m, n_embd), a copy."""
        start, m = self._span(n_tokens)
        return np.array(heads.nextn_rows(self._ctx, start + m, n_embd)[start:], copy=True)


class SeqTap(TargetTap):
    """Sequence `seq`'s rows of a MultiSeq's last decode (a batch slot's prompt chunk or verify rows)."""

    def __init__(self, ms, seq: int) -> None:
        self._ctx = ms.ctx_handle
        self.n_batch = int(ms.n_batch)
        self.ms = ms
        self.seq = int(seq)

    def _span(self, n_tokens: int) -> tuple[int, int]:
        span = self.ms.last_rows.get(self.seq)
        if span is None or span[1] != int(n_tokens):
            raise DecodeError(f"sequence {self.seq} decoded {span[1] if span else 0} rows in the last batch, "
                              f"not {n_tokens}: its hidden states are not there")
        return span
