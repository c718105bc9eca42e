"""MTP: the target's own multi-token-prediction (nextn) layer as the drafter (llama.cpp's `draft-mtp`).

As common/speculative.cpp does it at the vendored commit:
- the target is loaded with `load_mtp`, and a second context on the same model has ctx_type MTP;
- the target context outputs its nextn hidden state for every row (llama_set_embeddings_nextn(ctx, true, false));
- after every target decode the MTP context decodes the pairs (token[k], h[k-1]) at position pos[k] (the first
  token pairs with the previous decode's row at pos[0] - 1), so its KV follows the target's;
- propose() decodes (pending, h[P]) at the pending position, then each drafted token with the MTP layer's own
  hidden state.

As with EAGLE-3 the h row is looked up by position in the last decode's rows: no accept() feedback is needed.

Several MTP layers (`{arch}.nextn_predict_layers` > 1): on the archs whose llama.cpp MTP graph takes any of its
layers (llama_set_nextn_layer_offset: step35, mimo2, hy-v3) the heads chain as llama.cpp's `chain_heads` does:
after every target decode each head decodes the same rows into its own layer's KV, and draft step i runs head i on
the whole prefix [pending, d1..di] (k is capped at the number of heads). The other archs' graphs run one MTP layer
only (GGML_ASSERT n_layer_nextn == 1, an abort): such a target is refused in one line.

Hybrid targets (qwen35: gated delta net + attention, the arch most MTP models ship as): llama.cpp gives the MTP
context a plain KV cache on the nextn layer, so only the target holds recurrent state; it rolls back through
Model.truncate (RS planes, or a checkpoint and a replay, which the engine passes to after_target_decode like any
decode). Tested on a fabricated qwen35 with an MTP layer (tests/test_heads.py).
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from localspec.sample.sampling import SamplingParams
from localspec.drafters.base import Drafter, Proposal, draft_loop
from localspec.drafters.eagle3 import top10_p
from localspec.errors import IncompatibleDraftError
from localspec.llama.headarchs import CHAIN_MTP_ARCHS as CHAIN_ARCHS


class MtpDrafter(Drafter):
    name = "mtp"
    title = "MTP"  # the target's own multi-token-prediction layers
    prior_alpha = 0.7

    def __init__(self, target, *, p_min: float = 0.75, cost: float | None = None, tap=None) -> None:
        """target: a Model loaded with load_mtp=True whose GGUF has nextn layers; tap: where the target's nextn states
        are read (llama.taps; None: the target's own context). Raises IncompatibleDraftError."""
        from localspec.llama import heads  # lazily: the registry is imported by front ends that never load a model
        heads.require_head("mtp")
        n_nextn = heads.n_nextn_of(target.model_handle)
        if n_nextn <= 0:
            raise IncompatibleDraftError(f"{target.name} has no MTP (nextn) layers")
        arch = heads.arch_of(target.model_handle)
        if n_nextn > 1:
            if arch not in CHAIN_ARCHS:
                raise IncompatibleDraftError(
                    f"{target.name} has {n_nextn} MTP layers, and llama.cpp's {arch} MTP graph runs only one "
                    f"(chained MTP layers: {', '.join(sorted(CHAIN_ARCHS))} targets)")
            if "llama_set_nextn_layer_offset" in heads.ext.missing():
                raise IncompatibleDraftError(f"--method mtp is unavailable for {target.name}'s {n_nextn} MTP layers: "
                                             "this llama-cpp-python build lacks llama_set_nextn_layer_offset")
        self.n_heads = n_nextn
        self.chain = n_nextn > 1
        self.target = target
        self.p_min = p_min
        self._cost = cost
        self.n_embd = heads.n_embd_of(target.model_handle)
        self.ctx = heads.HeadContext(target.model_handle, n_ctx=target.n_ctx, n_batch=target.n_batch,
                                     n_threads=target.n_threads, kv_type=target.kv_type,
                                     ctx_type=heads.CONTEXT_TYPE_MTP, name=f"{target.name} (MTP)")
        if tap is None:
            from localspec.llama.taps import TargetTap

            tap = TargetTap(target)
        self.tap = tap
        tap.enable_nextn()
        heads.set_nextn(self.ctx.ctx, True, True)
        self._h: np.ndarray | None = None
        self._h_pos0 = 0
        self.hook_s = 0.0
        self.hook_calls = 0

    def cost(self) -> float | None:
        return self._cost

    def _h_at(self, pos: int) -> np.ndarray | None:
        if self._h is None or pos < self._h_pos0 or pos >= self._h_pos0 + len(self._h):
            return None
        return self._h[pos - self._h_pos0]

    def after_target_decode(self, tokens: Sequence[int], positions: Sequence[int]) -> None:
        from localspec.llama import heads  # lazily: the registry is imported by front ends that never load a model
        t0 = time.perf_counter()
        n = len(tokens)
        if n == 0:
            return
        h = self.tap.nextn(n, self.n_embd)  # the target's own context keeps only a long prompt's last chunk
        m = len(h)
        toks = [int(t) for t in tokens[n - m:]]
        pos0 = int(positions[n - m])
        prev = self._h_at(pos0 - 1)
        rows = [(toks[0], pos0, prev, False)] if prev is not None else []
        rows += [(toks[k], pos0 + k, h[k - 1], False) for k in range(1, m)]
        if rows:
            step = self.ctx.n_ubatch
            for head in range(self.n_heads):  # chained heads: each writes its own layer's KV for the same rows
                self.ctx.prepare(rows[0][1])
                if self.chain:
                    self._offset(head)
                for i in range(0, len(rows), step):
                    self.ctx.process(heads.PROCESS_DECODE, rows[i:i + step])
            if self.chain:
                self._offset(0)
        self._h, self._h_pos0 = h, pos0
        self.hook_s += time.perf_counter() - t0
        self.hook_calls += 1

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator) -> Proposal:
        from localspec.llama import heads  # lazily: the registry is imported by front ends that never load a model
        pos0 = len(context) - 1  # the pending token's position
        h = self._h_at(pos0 - 1)
        room = self.target.n_ctx - len(context) - 1
        k = min(k, max(room, 0))
        if k <= 0 or h is None:
            return Proposal()
        self.ctx.prepare(pos0)
        if self.chain:
            return self._propose_chain(context, min(k, self.n_heads), h, sp, rng)
        self.ctx.process(heads.PROCESS_DECODE, [(int(context[-1]), pos0, h, True)])
        p_min = self.p_min

        def next_row(t: int, i: int) -> np.ndarray:
            hn = self.ctx.nextn_ith(0, self.n_embd)
            self.ctx.process(heads.PROCESS_DECODE, [(t, pos0 + 1 + i, hn, True)])
            return self.ctx.logits(0)

        return draft_loop(self.ctx.logits(0), k, sp, rng, next_row,
                          lambda row: p_min <= 0.0 or top10_p(row) >= p_min)

    def _offset(self, head: int) -> None:
        from localspec.llama import heads

        heads.ext.fn("llama_set_nextn_layer_offset")(self.ctx.ctx, int(head))

    def _propose_chain(self, context: Sequence[int], k: int, h: np.ndarray, sp: SamplingParams,
                       rng: np.random.Generator) -> Proposal:
        """Draft step i under head i, on the whole prefix: the heads' KV in the draft region is each one's own."""
        from localspec.llama import heads

        pos0 = len(context) - 1
        rows = [(int(context[-1]), pos0, h)]  # (token, pos, h): the prefix, one more row per drafted token
        p_min = self.p_min

        def run(head: int) -> np.ndarray:
            self.ctx.seq_rm(pos0)
            self._offset(head)
            n = len(rows)
            self.ctx.process(heads.PROCESS_DECODE, [(t, p, hh, i == n - 1) for i, (t, p, hh) in enumerate(rows)])
            return self.ctx.logits(n - 1)

        def next_row(t: int, i: int) -> np.ndarray:
            rows.append((t, pos0 + 1 + i, self.ctx.nextn_ith(i, self.n_embd)))
            return run(i + 1)

        try:
            return draft_loop(run(0), k, sp, rng, next_row, lambda row: p_min <= 0.0 or top10_p(row) >= p_min)
        finally:
            self._offset(0)

    def for_sequence(self, tap) -> "MtpDrafter":
        """An MTP context of its own fed from `tap` (a batch slot's rows of each batched decode)."""
        return MtpDrafter(self.target, p_min=self.p_min, cost=self._cost, tap=tap)

    def keep(self, n: int) -> None:
        """The sequence keeps only its first n tokens (a new request in a batch slot): the pair at k holds token k and
        the state at k - 1, an h row at P reads tokens up to P."""
        n = max(int(n), 0)
        self.ctx.seq_rm(n)
        if self._h is not None:
            self._h = self._h[:n - self._h_pos0] if n > self._h_pos0 else None

    def close(self) -> None:
        self.ctx.close()  # the model is the target's

    @classmethod
    def load(cls, target, path=None, *, p_min: float = 0.75, n_gpu_layers: int = 0) -> "MtpDrafter":  # noqa: ARG003
        from localspec.llama import heads

        # cost: one layer of the target's n_layer + 1 (a memory-bound first guess)
        return cls(target, p_min=p_min, cost=1.0 / (heads.n_layer_of(target.model_handle) + 1))
