"""DFlash: a block-diffusion draft head on the target's hidden states (llama.cpp's `draft-dflash`).

As common/speculative.cpp does it at the vendored commit (plain DFlash; a DSpark head, the same file with a Markov
head, runs as drafters/dspark.py; DFlash2's selector lattice is refused):
- the target context extracts the inputs of the head's target layers (llama_set_embeddings_layer_inp);
- after every target decode, the concatenated layer-input rows are decoded as embedding rows into the head's
  context at the target's positions: its graph fuses them (fc, enc.output_norm) and writes them into its KV cache;
- propose() decodes one block [pending, mask x k] at positions P..P+k with non-causal attention (every row sees the
  injected cache and the whole block): row i's logits name the token at P+i, so one decode gives the whole draft;
  the block's own K/V are then removed from the head's cache (only the target's features stay there);
- k is capped by the trained `dflash.block_size` (block_size - 1 drafted tokens).

Each position's injected row is the target's own hidden state there, so rollbacks need only `prepare(first)` before
the next injection (drop what the cache holds from there on): no accept() feedback.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from localspec.sample.sampling import SamplingParams
from localspec.drafters.base import HeadFileDrafter, Offer, Proposal, draft_loop
from localspec.drafters.eagle3 import top10_p
from localspec.errors import IncompatibleDraftError

MARKOV_TENSOR = "markov_w1.weight"  # what makes a dflash-arch GGUF a DSpark head (common_speculative_types_from_gguf)


class DFlashDrafter(HeadFileDrafter):
    head_kind = "dflash"
    name = "dflash"
    prior_alpha = 0.5
    markov = False  # whether the file carries a Markov head (markov_w1.weight): a DSpark head
    title = "DFlash"  # the head's name in messages

    def __init__(self, target, head: "HeadModel", *, p_min: float = 0.75, cost: float | None = None,
                 tap=None) -> None:
        """target: the loaded target Model; head: the dflash GGUF (heads.HeadModel); tap: where the target's hidden
        states are read (llama.taps; None: the target's own context). Raises IncompatibleDraftError (one line) for a
        build without the calls, a head of another kind or a target it cannot read."""
        from localspec.llama import heads, lib  # lazily: the registry is imported by front ends that never load a model
        heads.require_head(self.head_kind)
        if head.arch != "dflash":
            raise IncompatibleDraftError(f"{head.name} is not a DFlash head (its architecture is {head.arch})")
        ll = lib.require()
        m = head.model_handle
        if int(heads.ext.fn("llama_model_dflash_selector_top_k")(m)) > 0:
            raise IncompatibleDraftError(f"{head.name} is a DFlash2 head (a selector lattice), which localspec does "
                                         "not drive yet (DFlash and DSpark heads are supported)")
        if heads.meta_str(m, "dflash.hyper_connection.count") not in (None, "0"):
            raise IncompatibleDraftError(f"{head.name} is a DeepSeek-V4 DSpark head, which localspec does not drive "
                                         "yet (DFlash and DSpark heads are supported)")
        if heads.has_tensor(head.path, MARKOV_TENSOR) != self.markov:
            what = ("a plain DFlash head (no Markov head), not a DSpark head" if self.markov else
                    "a DSpark head (DFlash plus a Markov head), not a plain DFlash head")
            raise IncompatibleDraftError(f"{head.name} is {what}")
        self.target = target
        self.head = head
        self.p_min = p_min
        self._cost = cost
        self.layer_ids = heads.target_layer_ids(m)
        if not self.layer_ids:
            raise IncompatibleDraftError(f"{head.name} names no target layers (dflash.target_layers)")
        heads.check_layer_inp_target(target, self.title, self.layer_ids)  # before any flag is set
        # llama.cpp's graph fuses the target layers' inputs at the head's own width (fc takes layers x n_embd of
        # the head), so a head reads only a target as wide as itself: a wider one's rows would not fit its batch
        self.n_embd_tgt = heads.n_embd_of(target.model_handle)
        if head.n_embd != self.n_embd_tgt:
            raise IncompatibleDraftError(f"{head.name} was trained on a target of hidden size {head.n_embd}, "
                                         f"{target.name} has {self.n_embd_tgt}")
        if heads.n_vocab_of(m) != target.n_vocab:
            raise IncompatibleDraftError(f"{head.name} has a vocabulary of {heads.n_vocab_of(m)} tokens, "
                                         f"{target.name} has {target.n_vocab}")
        self.mask = int(ll.llama_vocab_mask(ll.llama_model_get_vocab(m)))
        if self.mask < 0:
            raise IncompatibleDraftError(f"{head.name} declares no mask token (tokenizer.ggml.mask_token_id)")
        self.block_size = int(heads.meta_str(m, "dflash.block_size") or 16)
        if self.block_size < 2:
            raise IncompatibleDraftError(f"{head.name} has a block size of {self.block_size}: it drafts nothing")
        causal = heads.meta_str(m, "dflash.attention.causal") == "true"
        self.ctx = heads.HeadContext(m, n_ctx=target.n_ctx, n_batch=target.n_batch, n_threads=target.n_threads,
                                     kv_type=target.kv_type, ctx_other=target.ctx_handle, name=head.name)
        self.tap = self._tap_for(target, tap)
        self.tap.enable_layer_inp(self.layer_ids)
        heads.set_nextn(self.ctx.ctx, True, True)
        ll.llama_set_causal_attn(self.ctx.ctx, causal)  # DFlash attends non-causally unless the model says otherwise
        self.hook_s = 0.0  # time in after_target_decode (the per-step overhead the head adds to every decode)
        self.hook_calls = 0

    @property
    def k_max(self) -> int:
        return self.block_size - 1

    def offer(self, context: Sequence[int], k: int) -> Offer | None:
        k = min(k, self.k_max)
        return Offer(k, self.name) if k > 0 else None

    # ---------------------------------------------------------------- hook
    def after_target_decode(self, tokens: Sequence[int], positions: Sequence[int]) -> None:
        from localspec.llama import heads  # lazily: the registry is imported by front ends that never load a model
        t0 = time.perf_counter()
        if len(tokens) == 0:
            return
        m, pos0, feats = self._target_features(tokens, positions)
        self.ctx.prepare(pos0)
        step = self.ctx.n_ubatch
        for i in range(0, m, step):
            c = min(step, m - i)
            self.ctx.process(heads.PROCESS_DECODE, [(None, pos0 + i + j, feats[i + j], False) for j in range(c)])
        self.hook_s += time.perf_counter() - t0
        self.hook_calls += 1

    # ------------------------------------------------------------- propose
    def _room(self, context: Sequence[int], extra_rows: int) -> int:
        """The most tokens a block with `extra_rows` rows besides the drafted ones may draft: the target's context
        must hold the verify, the head's ubatch the block."""
        return max(min(self.target.n_ctx - len(context) - 1, self.ctx.n_ubatch - extra_rows), 0)

    def _decode_block(self, context: Sequence[int], n_rows: int) -> bool:
        """Decode the block [pending, mask x (n_rows - 1)] from the pending token's position P, every row an
        output; False (nothing decoded) when the head's cache does not hold the target's features up to P - 1.
        The caller reads the rows, then drops the block (seq_rm(P))."""
        from localspec.llama import heads  # lazily: the registry is imported by front ends that never load a model
        P = len(context) - 1  # the pending token's position: the target holds 0..P-1
        self.ctx.seq_rm(P)  # features of rejected drafts (the target rolled back past them)
        if self.ctx.pos_max() != P - 1:
            return False
        block = [(int(context[-1]), P, None, True)] + [(self.mask, P + i, None, True) for i in range(1, n_rows)]
        self.ctx.process(heads.PROCESS_DECODE, block)
        return True

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator) -> Proposal:
        k = min(k, self.k_max, self._room(context, 1))
        if k <= 0 or not self._decode_block(context, k + 1):
            return Proposal()
        rows = np.stack([self.ctx.logits(1 + i) for i in range(k)])  # the k mask rows (a copy)
        self.ctx.seq_rm(len(context) - 1)  # the block is a guess, not context: only the target's features stay
        p_min = self.p_min
        return draft_loop(rows[0], k, sp, rng, lambda t, i: rows[i + 1],
                          lambda row: p_min <= 0.0 or top10_p(row) >= p_min)
