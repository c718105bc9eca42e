"""EAGLE-3: a one-layer draft head trained on the target's hidden states (llama.cpp's `draft-eagle3`).

As common/speculative.cpp does it at the vendored commit:
- the target context extracts the inputs of the head's three target layers (llama_set_embeddings_layer_inp);
- after every target decode, an encode pass maps the concatenated hidden rows to g rows (the head's fc), then the
  decoder writes the pairs (token[P+1], g[P]) at position P into the head's KV cache; the last row of a decode has no
  token P+1 yet: it is the deferred boundary, written by the next decode (its first token) or by propose() (the
  pending token), whichever comes first;
- propose() decodes the boundary pair, then feeds each drafted token back with the head's pre-norm state;
- the head's logits come out over the target vocabulary (its `d2t` map is applied in llama.cpp's graph).

The boundary's g row is looked up by position in the last decode's rows, so the drafter needs no accept() feedback:
whoever drafted, after `truncate` the boundary is the last position the target kept.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from localspec.sample.sampling import SamplingParams
from localspec.drafters.base import HeadFileDrafter, Proposal, draft_loop
from localspec.errors import IncompatibleDraftError


def top10_p(row: np.ndarray) -> float:
    """The top token's probability among the 10 best at temperature 1 (llama.cpp's draft sampler: top_k 10)."""
    top = np.partition(row, -10)[-10:] if row.shape[-1] > 10 else row
    top = top[np.isfinite(top)]
    m = float(top.max())
    return 1.0 / float(np.exp(top - m).sum())


class Eagle3Drafter(HeadFileDrafter):
    head_kind = "eagle3"
    name = "eagle3"
    title = "EAGLE-3"  # the head's name in messages
    prior_alpha = 0.6

    def __init__(self, target, head: "HeadModel", *, p_min: float = 0.75, cost: float | None = None,
                 tap=None) -> None:
        """target: the loaded target Model; head: the eagle3 GGUF (heads.HeadModel); tap: where the target's hidden
        states are read (llama.taps; None: the target's own context). Raises IncompatibleDraftError (one line) for a
        build without the calls, a head that is not EAGLE-3 or a target it cannot read."""
        from localspec.llama import heads  # lazily: the registry is imported by front ends that never load a model
        heads.require_head("eagle3")
        if head.arch != "eagle3":
            raise IncompatibleDraftError(f"{head.name} is not an EAGLE-3 head (its architecture is {head.arch})")
        self.target = target
        self.head = head
        self.p_min = p_min
        self._cost = cost
        self.layer_ids = heads.target_layer_ids(head.model_handle)
        if len(self.layer_ids) != 3:
            raise IncompatibleDraftError(f"{head.name} is not an EAGLE-3 head (it reads {len(self.layer_ids)} target "
                                         "layers, EAGLE-3 reads 3)")
        heads.check_layer_inp_target(target, "EAGLE-3", self.layer_ids)  # before any flag is set
        self.n_embd_tgt = heads.n_embd_of(target.model_handle)
        self.n_embd = head.n_embd
        n_tgt = int(heads.meta_str(head.model_handle, "eagle3.target_hidden_size") or 0)
        if n_tgt and n_tgt != self.n_embd_tgt:
            raise IncompatibleDraftError(f"{head.name} was trained on a target of hidden size {n_tgt}, "
                                         f"{target.name} has {self.n_embd_tgt}")
        if heads.n_vocab_of(head.model_handle) != target.n_vocab:
            raise IncompatibleDraftError(f"{head.name} has a vocabulary of {heads.n_vocab_of(head.model_handle)} tokens, "
                                         f"{target.name} has {target.n_vocab}")
        self.ctx = heads.HeadContext(head.model_handle, n_ctx=target.n_ctx, n_batch=target.n_batch,
                                     n_threads=target.n_threads, kv_type=target.kv_type, ctx_other=target.ctx_handle,
                                     name=head.name)
        self.tap = self._tap_for(target, tap)
        self.tap.enable_layer_inp(self.layer_ids)
        heads.set_nextn(self.ctx.ctx, True, True)
        self._g: np.ndarray | None = None  # g rows of the target's last decode
        self._g_pos0 = 0  # position of self._g[0]
        self.hook_s = 0.0  # time in after_target_decode (the per-step overhead the head adds to every decode)
        self.hook_calls = 0

    # ---------------------------------------------------------------- hook
    def after_target_decode(self, tokens: Sequence[int], positions: Sequence[int]) -> None:
        from localspec.llama import heads  # lazily: the registry is imported by front ends that never load a model
        t0 = time.perf_counter()
        if len(tokens) == 0:
            return
        m, pos0, feats = self._target_features(tokens, positions)
        toks = [int(t) for t in tokens[len(tokens) - m:]]
        g = np.empty((m, self.n_embd), dtype=np.float32)
        step = self.ctx.n_ubatch
        for i in range(0, m, step):
            c = min(step, m - i)
            # the per-token encoder ignores positions; llama.cpp wants them to continue the memory's
            p = self.ctx.pos_max() + 1
            self.ctx.process(heads.PROCESS_ENCODE, [(None, p + j, feats[i + j], True) for j in range(c)])
            g[i:i + c] = self.ctx.nextn(c, self.n_embd)
        rows = []
        prev = self._g_at(pos0 - 1)
        first = pos0 - 1 if prev is not None else pos0
        if prev is not None:  # the previous decode's deferred boundary, completed by this decode's first token
            rows.append((toks[0], pos0 - 1, prev, False))
        rows += [(toks[k + 1], pos0 + k, g[k], False) for k in range(m - 1)]
        self.ctx.prepare(first)
        for i in range(0, len(rows), step):
            self.ctx.process(heads.PROCESS_DECODE, rows[i:i + step])
        self._g, self._g_pos0 = g, pos0
        self.hook_s += time.perf_counter() - t0
        self.hook_calls += 1

    def keep(self, n: int) -> None:
        # the pair at P holds token P + 1; a g row at P reads tokens up to P
        n = max(int(n), 0)
        self.ctx.seq_rm(max(n - 1, 0))
        if self._g is not None:
            self._g = self._g[:n - self._g_pos0] if n > self._g_pos0 else None

    def _g_at(self, pos: int) -> np.ndarray | None:
        if self._g is None or pos < self._g_pos0 or pos >= self._g_pos0 + len(self._g):
            return None
        return self._g[pos - self._g_pos0]

    # ------------------------------------------------------------- propose
    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator) -> Proposal:
        from localspec.llama import heads  # lazily: the registry is imported by front ends that never load a model
        P = len(context) - 2  # the last position the target holds: its g row pairs with the pending token
        g = self._g_at(P)
        room = self.target.n_ctx - len(context) - 1
        k = min(k, max(room, 0))
        if k <= 0 or g is None:
            return Proposal()
        self.ctx.prepare(P)
        self.ctx.process(heads.PROCESS_DECODE, [(int(context[-1]), P, g, True)])
        p_min = self.p_min

        def next_row(t: int, i: int) -> np.ndarray:
            pre = self.ctx.nextn_ith(0, self.n_embd)
            self.ctx.process(heads.PROCESS_DECODE, [(t, P + 1 + i, pre, True)])
            return self.ctx.logits(0)

        return draft_loop(self.ctx.logits(0), k, sp, rng, next_row,
                          lambda row: p_min <= 0.0 or top10_p(row) >= p_min)
