"""DSpark: a DFlash head plus a Markov head and, optionally, a confidence head (llama.cpp's `draft-dspark`).

As common/speculative.cpp and src/models/dflash.cpp run it at the vendored commit:
- the file is a `dflash`-arch GGUF that holds `markov_w1.weight` (how llama.cpp tells it from plain DFlash), so
  `-d head.gguf` with `--method dflash` (or auto) runs it; the target's features reach the head's cache exactly as
  for DFlash (DFlashDrafter.after_target_decode);
- llama.cpp's graph adds the Markov bias w2 . w1[prev] to each row of the block: prev is the anchor (the pending
  token) for the first drafted row and the argmax of the row before after that, so one decode drafts a chain;
- anchor-first layout (`dflash.sample_from_anchor` true or absent): the block is [pending, mask x (k-1)] and rows
  0..k-1 name the k drafted tokens (k <= block_size); the bonus-anchor layout (false) is DFlash's
  [pending, mask x k], rows 1..k (k <= block_size - 1). A block longer than block_size would get no Markov bias;
- the confidence head (`conf_proj`, where the file has one) gives each row the chance it is accepted, broadcast
  over the row's nextn embedding: with p_min > 0 the draft ends at the first row below p_min (llama.cpp's
  `--spec-draft-p-min`). A head without one is gated as DFlash is (the row's top-10 probability against p_min).

Above temperature 0 a drafted token is a sample from its row; the rows after it were conditioned on the row's
argmax, so the draft ends after a sample that is not that argmax (later rows would answer another prefix).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from localspec.drafters.base import Proposal, draft_token
from localspec.drafters.dflash import MARKOV_TENSOR, DFlashDrafter
from localspec.drafters.eagle3 import top10_p
from localspec.sample.sampling import SamplingParams

CONF_TENSOR = "conf_proj.weight"


class DSparkDrafter(DFlashDrafter):
    head_kind = "dspark"  # what it needs from the build (llama/ext.py NEEDS); it runs as --method dflash
    markov = True
    title = "DSpark"

    def __init__(self, target, head: "HeadModel", *, p_min: float = 0.75, cost: float | None = None,
                 tap=None) -> None:
        """As DFlashDrafter, for a file with a Markov head."""
        from localspec.llama import heads  # lazily: the registry is imported by front ends that never load a model
        super().__init__(target, head, p_min=p_min, cost=cost, tap=tap)
        self.anchor_first = heads.meta_str(head.model_handle, "dflash.sample_from_anchor") in (None, "true")
        self.has_conf = heads.has_tensor(head.path, CONF_TENSOR)
        self.n_embd_head = head.n_embd

    @staticmethod
    def in_file(path) -> bool:
        """Whether the GGUF at `path` is a DSpark head (its header lists the Markov head's tensor)."""
        from localspec.llama import heads  # lazily: the registry is imported by front ends that never load a model
        return heads.has_tensor(path, MARKOV_TENSOR)

    @property
    def k_max(self) -> int:
        return self.block_size if self.anchor_first else self.block_size - 1

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator) -> Proposal:
        skip = 0 if self.anchor_first else 1  # rows before the first drafted one
        k = min(k, self.k_max, self._room(context, skip))
        if k <= 0 or not self._decode_block(context, k + skip):
            return Proposal()
        rows = np.stack([self.ctx.logits(skip + i) for i in range(k)])  # a copy
        conf = None
        if self.has_conf and self.p_min > 0.0:
            conf = self.ctx.nextn(k + skip, self.n_embd_head)[skip:, 0]
        self.ctx.seq_rm(len(context) - 1)  # the block is a guess, not context: only the target's features stay
        p_min = self.p_min
        gate = None if conf is not None else (lambda row: p_min <= 0.0 or top10_p(row) >= p_min)
        tokens: list[int] = []
        qs: list[np.ndarray] = []
        for i in range(k):
            if conf is not None and conf[i] < p_min:
                break
            t, q = draft_token(rows[i], sp, rng, gate)
            if t is None:
                break
            tokens.append(t)
            if q is not None:
                qs.append(q)
            if t != int(np.argmax(rows[i])):  # the graph conditioned row i + 1 on the argmax, not on t
                break
        return Proposal(tokens, np.stack(qs) if qs else None)
