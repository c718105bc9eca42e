"""A draft model that drafts for every slot of a BatchEngine in one batch.

The single-sequence path drafts with drafters/draft_model.py: the draft model's own context, one sequence. Here the
draft model gets a MultiSeq (llama/multiseq.py: a second context on its weights) with one sequence per slot, and a
step drafts for every slot that chose the draft model together:

1. catch-up: each drafting slot's sequence is rolled back to what it shares with the slot's context (or takes a
   longer prefix from another slot's sequence) and the rest of the context is decoded (logits at each slot's last
   row) - every slot's catch-up rows in ONE decode; a slot more than `chunk` tokens behind (a new long prompt)
   decodes one chunk a step beside the others and drafts nothing until it is caught up, as the target prefills;
2. k rounds of one decode with one row per slot still drafting (greedy argmax, or a sample from q shaped like the
   target's p with the request's own rng; the q rows are kept for speculative sampling; the request's logit_bias
   on the rows, as the single path's draft_loop does). A slot stops early when the draft model is unsure (p_min,
   as DraftModelDrafter) or drafts an end-of-generation token (nothing after it can be emitted);
3. after the target's verify, each slot's rejected draft rows are removed from its sequence (`accept`).

So the draft model's decodes per step are one catch-up decode plus at most k draft decodes, for all drafting slots
together, instead of (1 + k) per slot. Each slot's policy sees a `SlotDrafter` (name "draft", the Drafter contract):
its propose() hands over what this step's batch drafted for it, and its time is the slot's share of the batch's
draft time (its rows over all rows), as the target's verify time is shared in core/batch.py.

Draft models do not change the exactness level: the target verifies every token. A batched draft need not be
bit-identical to the single-sequence draft (it is on the CPU builds measured, where the texts then match the
single path's even when sampling).

A recurrent/hybrid draft model rolls each slot's sequence back on its own (llama/multiseq.py): before the rounds
every drafting slot saves its state, so rejected drafts are undone by a restore (or a plane) and the accepted ones
decoded again with the step's other replays. A draft model that cannot roll back at all (rollback "none") keeps
draft-model requests on the single-sequence path (BatchEngine.single_reason says so).
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from localspec.sample.sampling import SamplingParams
from localspec.drafters.base import Drafter, Proposal, draft_token
from localspec.drafters.draft_model import confident, target_row
from localspec.seq import common_prefix

CATCH_UP_CHUNK = 256  # context tokens a slot's draft sequence catches up per step at most (BatchEngine: its prefill_chunk)
CATCH_UP_TIMED = 2  # catch-up rows beyond this make a step's draft time a catch-up, not a per-token cost (as the
# single path: after a fully accepted proposal a slot decodes its last draft and the target's bonus token)


# a sequence's rollback counters before its context exists (llama/seqstate.py's fields)
NO_ROLLBACKS = {"restores": 0, "replayed_tokens": 0, "rs_rollbacks": 0, "checkpoint_bytes": 0, "save_s": 0.0,
                "restore_s": 0.0}


def batch_draft_reason(engine) -> str:
    """Why draft-model requests cannot be batched with `engine`'s draft model ('' when they can)."""
    draft = engine.draft
    if draft is None:
        return ""
    if draft.rollback_kind == "none":
        return (f"the draft model {draft.name} keeps a recurrent state that cannot be rolled back here: draft-model "
                "requests run on the single-sequence path")
    return ""


class SlotDrafter(Drafter):
    """One slot's view of the batched draft model (what its policy chooses and gets feedback on)."""

    name = "draft"
    prior_alpha = 0.6

    def __init__(self, owner: "BatchDraft", seq: int) -> None:
        self.owner = owner
        self.seq = seq
        self.p_min = 0.75
        self.ready: Proposal | None = None  # what this step's batch drafted for this slot
        self.base = 0  # the slot's context length when it was drafted (its sequence then holds context + drafts)
        self.decoded = 0  # drafts of that proposal decoded into the sequence

    def cost(self) -> float | None:
        return self.owner.cost

    def lag(self, context: Sequence[int]) -> int:
        return len(context) - common_prefix(self.owner.tokens(self.seq), context)

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator) -> Proposal:
        """This step's proposal, drafted in the batch (BatchDraft.draft) before the target's rows were gathered."""
        out, self.ready = self.ready, None
        if out is None:  # not drafted in a batch this step (a caller outside BatchEngine): a batch of one
            self.owner.draft_for([(self, context, k, sp, rng)])
            out, self.ready = self.ready, None
        if len(out.tokens) > k:
            out = Proposal(out.tokens[:k], None if out.q is None else out.q[:k], out.catch_up_s)
        return out

    def accept(self, n_drafted: int, n_accepted: int) -> None:
        """Roll the rejected drafts out of the slot's sequence (the accepted ones are context now)."""
        self.owner.truncate(self.seq, self.base + min(n_accepted, self.decoded))


class BatchDraft:
    """The draft model of `engine` with one sequence per slot, decoded together. Not thread-safe (the BatchEngine's
    thread). The MultiSeq is made at the first draft, so a server whose requests never use the draft model does not
    hold its KV cache."""

    def __init__(self, engine, n_slots: int, *, unified: bool = False, chunk: int = CATCH_UP_CHUNK) -> None:
        """chunk: context tokens a slot's sequence catches up per step at most (a new long prompt is decoded over
        several steps, as the target prefills it, and the slot drafts nothing until it is caught up)."""
        self.model = engine.draft
        self.chunk = max(1, int(chunk))
        self.target = engine.target
        self.n_vocab = engine.target.n_vocab
        self.n_slots = n_slots
        self.unified = unified
        self.cost = self.model.size_bytes() / max(self.target.size_bytes(), 1)  # decoding is memory-bound
        self.ms = None
        self.slots = [SlotDrafter(self, s) for s in range(n_slots)]
        self.catch_up_decodes = 0  # decodes of the last draft() (tests, measurements)
        self.draft_decodes = 0

    @classmethod
    def for_engine(cls, engine, n_slots: int, *, unified: bool = False, chunk: int = CATCH_UP_CHUNK
                   ) -> "BatchDraft | None":
        """None when the engine has no draft model, or one that cannot share a batch."""
        if engine.draft is None or batch_draft_reason(engine) or engine.draft_kind == "cross-vocab":
            return None  # another vocabulary drafts through text, per slot: core/batch_xvocab.py
        return cls(engine, n_slots, unified=unified, chunk=chunk)

    # ------------------------------------------------------------ sequences
    def _multiseq(self):
        if self.ms is None:
            from localspec.llama.multiseq import MultiSeq

            self.ms = MultiSeq(self.model, self.n_slots, unified=self.unified)
        return self.ms

    def tokens(self, seq: int) -> list[int]:
        return self.ms.tokens[seq] if self.ms is not None else []

    def truncate(self, seq: int, n_keep: int) -> None:
        if self.ms is not None:
            self.ms.truncate(seq, n_keep)

    @property
    def rollback_kind(self) -> str:
        """How a slot's rejected drafts leave its sequence: the MultiSeq's kind, or the model's before it exists."""
        return self.ms.rollback_kind if self.ms is not None else self.model.rollback_kind

    def rollback_counters(self, seq: int) -> dict:
        """Slot `seq`'s rollback counters on the draft model (zeros before its first draft)."""
        return self.ms.rollback_counters(seq) if self.ms is not None else dict(NO_ROLLBACKS)

    def flush(self) -> None:
        """Decode the slots' pending replays (a recurrent draft model's accepted drafts after a restore)."""
        if self.ms is not None:
            self.ms.flush()

    def drafter(self, seq: int, p_min: float) -> SlotDrafter:
        d = self.slots[seq]
        d.p_min = p_min
        d.ready = None
        return d

    def clear(self) -> None:
        if self.ms is not None:
            self.ms.clear()

    def close(self) -> None:
        if self.ms is not None:
            self.ms.close()
            self.ms = None

    # ------------------------------------------------------------ one step
    def draft(self, chosen) -> dict[int, float]:
        """Draft for every (run, drafter, k) in `chosen` whose drafter is one of this model's slots, in one batch
        (`run`: a BatchEngine request, with seq, context, sp_draft and source()). Each SlotDrafter then holds its
        proposal for propose(). Returns seq -> that slot's share of the draft time, in seconds."""
        chosen = [(run, getattr(d, "model", d), k) for run, d, k in chosen]  # a chain drafts its model's part here
        work = [(d, run.context, k, run.sp_draft, run.source()) for run, d, k in chosen
                if k > 0 and isinstance(d, SlotDrafter) and d.owner is self]
        return self.draft_for(work) if work else {}

    def draft_for(self, work: list[tuple[SlotDrafter, Sequence[int], int, SamplingParams, np.random.Generator]]
                  ) -> dict[int, float]:
        ms = self._multiseq()
        self.catch_up_decodes = self.draft_decodes = 0
        slots, behind = [], []
        for d, context, k, sp, rng in work:
            k = min(k, ms.n_ctx - len(context) - 1)  # the draft decodes at most k-1 tokens after the context
            if k <= 0:
                d.ready = Proposal()
                continue
            common = ms.take_prefix(d.seq, context)  # its own cache's, or another slot's (a shared system prompt)
            if common == len(context):  # the last context token is decoded again for its logits
                common = ms.reachable(d.seq, common - 1)  # a recurrent state: where it gets back without a replay
            ms.truncate(d.seq, common)
            chunk = min(self.chunk, ms.n_batch)
            if len(context) - common > chunk:
                # far behind (a new long prompt): catch up one chunk this step, beside the others' catch-up, and
                # draft nothing, so the step does not stall every other request for the whole prompt
                behind.append((d, list(context[common:common + chunk])))
                continue
            slots.append(_Slot(d, list(context[common:]), k, sp, rng, len(context)))
        if not slots and not behind:
            return {}
        t0 = time.perf_counter()
        self._catch_up(slots, behind)
        for s in slots:
            if s.k > 1:  # a recurrent state cannot undo the rounds' one-row decodes: what their rollback restores
                ms.save_checkpoint(s.drafter.seq)
        t1 = time.perf_counter()
        per_row = (t1 - t0) / (sum(len(toks) for _, toks in behind) + sum(s.n_catch_up for s in slots))
        shares = {}
        for d, toks in behind:
            spent = per_row * len(toks)
            d.ready = Proposal([], None, spent)  # a catch-up, not a per-token cost
            shares[d.seq] = spent
        if not slots:
            return shares
        self._rounds(slots)
        t2 = time.perf_counter()
        rows_d = sum(s.decoded for s in slots) or 1
        for s in slots:
            catch = per_row * s.n_catch_up
            drafted = (t2 - t1) * s.decoded / rows_d
            d = s.drafter
            d.base, d.decoded = s.base, s.decoded
            d.ready = Proposal(s.tokens, np.stack(s.qs) if s.qs else None,
                               catch if s.n_catch_up > CATCH_UP_TIMED else 0.0)
            shares[d.seq] = catch + drafted
        return shares

    def _catch_up(self, slots: list["_Slot"], behind: list = ()) -> None:
        """Decode every slot's missing context tokens, as few decodes as fit: logits at each slot's last one; and
        the chunks of the slots still far behind (`behind`: (drafter, tokens), no logits), in the first decode."""
        ms = self.ms
        todo = {id(s): 0 for s in slots}  # rows of each slot decoded so far
        first = list(behind)
        while first or any(todo[id(s)] < s.n_catch_up for s in slots):
            budget, parts, owners = ms.n_batch, [], []
            while first and len(first[0][1]) <= budget:
                d, toks = first.pop(0)
                parts.append((d.seq, toks, []))
                owners.append((None, False))
                budget -= len(toks)
            for s in slots:
                done = todo[id(s)]
                n = min(s.n_catch_up - done, budget)
                if n <= 0:
                    continue
                last = done + n == s.n_catch_up
                parts.append((s.drafter.seq, s.pending[done:done + n], [n - 1] if last else []))
                owners.append((s, last))
                todo[id(s)] = done + n
                budget -= n
            outs = ms.decode(parts, copy=False)
            self.catch_up_decodes += 1
            for (s, last), rows in zip(owners, outs):
                if s is not None and last:
                    s.row = self._to_target(rows[0])

    def _rounds(self, slots: list["_Slot"]) -> None:
        """Up to k rounds: each slot still drafting takes a token from its row; one decode gives every slot its
        next row."""
        ms = self.ms
        live = list(slots)
        for i in range(max(s.k for s in slots)):
            nxt = []
            for s in live:
                t, q = draft_token(s.row, s.sp, s.rng, lambda row, p_min=s.p_min: confident(row, p_min))
                if t is None:
                    continue  # the draft model is unsure here (its own confidence at temperature 1)
                if q is not None:
                    s.qs.append(q)
                s.tokens.append(t)
                if len(s.tokens) < s.k and not self.target.is_eog(t):
                    nxt.append(s)
            if not nxt:
                break
            outs = ms.decode([(s.drafter.seq, [s.tokens[-1]], [0]) for s in nxt], copy=False)
            self.draft_decodes += 1
            for s, rows in zip(nxt, outs):
                s.row = self._to_target(rows[0])
                s.decoded += 1
            live = nxt

    def _to_target(self, logits: np.ndarray) -> np.ndarray:
        """Draft logits over the target's vocabulary, copied: the decode buffer is reused by the next decode."""
        return target_row(logits, self.n_vocab, copy=True)


class _Slot:
    """One slot's drafting in this step."""

    def __init__(self, drafter: SlotDrafter, pending: list[int], k: int, sp: SamplingParams,
                 rng: np.random.Generator, base: int) -> None:
        self.drafter = drafter
        self.pending = pending  # context tokens its sequence lacks (at least the last one)
        self.n_catch_up = len(pending)
        self.k = k
        self.sp = sp
        self.rng = rng
        self.p_min = drafter.p_min
        self.base = base
        self.row: np.ndarray | None = None
        self.tokens: list[int] = []
        self.qs: list[np.ndarray] = []
        self.decoded = 0  # drafted tokens decoded into its sequence (all but a last one that needed no row)
