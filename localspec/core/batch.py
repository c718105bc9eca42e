"""The scheduler: generations decoded together over one target, with speculation per request; one request alone
is the same scheduler with one slot.

N slots, one sequence each of a backend (core/backend.py): a MultiSeq's (llama/multiseq.py), or the target's own
context as one slot (`own_context`: what `run`, `chat`, `bench` and `serve --parallel 1` decode in; the differences
are listed at BatchEngine.__init__). A step gathers every active slot's rows into ONE llama_decode: a generating
slot's pending token and drafts, a joining slot's prompt chunk (at most `prefill_chunk` tokens, fewer beside
generating slots on a slow machine). Each request is a core/generation.py Generation, so grammars, logprobs and
logit_bias batch like any request. A draft head (EAGLE-3, DFlash, DSpark, MTP) drafts in its slot from
that slot's rows of each batched decode (core/batch_heads.py); a draft model of another vocabulary drafts per slot
on its own sequence (core/batch_xvocab.py).
Invariant per slot, as in a batch of one: the slot's sequence holds every context token but the pending one.
A recurrent/hybrid target (or draft model) rolls each slot back on its own (llama/multiseq.py: a plane, or the
slot's checkpoint and a replay); the replays of a step are decoded together after its verify, and each request's
stats count its slot's restores and replayed tokens, as a batch of one's do.

Rules, and why (docs/benchmarks.md, "Batching: the measurements behind its rules"):
- a slot's controller is timed by its share of the step and prices a verify of b rows by what it adds to the
  whole step (`_price_rows`, core/batch_shape.py), so k per request follows from the cost of the batch;
- a row's logits can depend on the other rows of its forward pass, so the probe (core/batch_exact.py) checks every
  pass shape a bit request can be in; a bit request stays bit while it shares only passes that matched, and from
  the first that did not it runs at lossless, its stats saying from which token and why;
- one pass per step where that pays: slots padded to the step's most rows (`_pad`), new requests placed to keep
  active slots consecutive (llama.cpp passes take consecutive sequences), a slot whose cache shares REUSE_MIN
  prompt tokens taken first;
- prompt states (core/batch_states.py): a request restores the longest kept state of its prompt's start that no
  slot holds, and a slot's state is kept where the slot decoded its prefix as a cold prefill does.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Iterator, Sequence


from localspec import defaults as D
from localspec.core.batch_draft import BatchDraft, batch_draft_reason
from localspec.core.batch_xvocab import CrossVocabSlots
from localspec.core.batch_heads import BatchHeads
from localspec.core.config import GenConfig
from localspec.core.batch_shape import PassShapes
from localspec.core.batch_states import SlotStates
from localspec.core.batch_exact import BatchExactness
from localspec.core.batch_pool import SlotPool
from localspec.core.batch_probe import ProbeResult
from localspec.core.backend import EngineSide, OwnContext, SeqBackend
from localspec.core.drafting import drafters_for
from localspec.core.generation import (Finished, Generation, Piece, check_bias, check_prompt, new_stats,
                                       speculates)
from localspec.core.policy import build_policy
from localspec.core.response import Response
from localspec.drafters import PromptLookupDrafter
from localspec.drafters.ngram_cache import NgramCacheDrafter
from localspec.errors import DecodeCancelled, UsageError
from localspec.knobs import knobs
from localspec.seq import common_prefix

PREFILL_CHUNK = 256  # prompt tokens a joining request decodes per step
PREFILL_STEP_S = 3.0  # ... at most this long beside generating requests, by the measured prefill rate
PREFILL_MIN = 16  # ... and never fewer than this many
REUSE_MIN = 16  # cached prompt tokens that make a new request take that slot (else: keep active slots consecutive)
# alone on the target's own context, no other request shares a pass: exactness is the Engine's (verify widths only)
ALONE = ProbeResult(True, "one request on the target's own context: no other request shares its passes")


class _Run(Generation):
    """One request in a slot: its Generation, the slot's sequence, and the prompt tokens not decoded yet."""

    def __init__(self, seq: int, prefill: list[int], *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.seq = seq
        self.prefill = prefill
        self.roll0: tuple[dict, dict | None] = ({}, None)  # the slot's rollback counters when it joined
        self.keep: list[int] = []  # the prompt's prefix whose state is kept once the slot holds it (_save)


class BatchEngine(PassShapes, SlotStates, BatchExactness):
    """N slots over `engine`'s target (a core.engine.Engine). Not thread-safe: one thread calls add() and step()."""

    def __init__(self, engine: EngineSide, n_slots: int, *, own_context: bool = False,
                 prefill_chunk: int = PREFILL_CHUNK, unified: bool | None = None, pad: bool | None = None,
                 layout: str = "split", speculative: bool = True) -> None:
        """own_context: one slot, the target's own context (core/backend.OwnContext), what a request decoded alone
        runs in (`run`, `chat`, `bench`, `serve --parallel 1`): its prompt decoded at once by the target's sync
        (prefix reuse, the prompt cache), the Engine's own drafters (their state outlives the request), exactness
        by verify width only (nothing shares its passes: no batch probe), a verify priced by the target's verify
        curve and a step by its wall time. Else the slots are sequences of a MultiSeq (llama/multiseq.py).
        layout: "split" (one KV stream per slot), "unified" (one KV cache for all slots) or "auto" (split until
        the probe; then unified where a full batch is not bit-identical anyway and `speculative`, see
        _choose_layout). unified (True/False) or LOCALSPEC_KV_UNIFIED=1/0 overrides it. pad: pad a step's slots to
        one pass (_pad; default by cost, LOCALSPEC_BATCH_PAD=1/0 forces it)."""
        if n_slots < 1:
            raise UsageError(f"need at least one slot, got {n_slots}")
        if own_context and n_slots != 1:
            raise UsageError(f"the target's own context holds one sequence, not {n_slots}")
        if layout not in D.KV_LAYOUTS:
            raise UsageError(f"the KV layout must be one of {', '.join(D.KV_LAYOUTS)}, got {layout!r}")
        self.engine = engine
        self.target = engine.target
        self.alone = own_context
        switches = knobs()
        if unified is None:
            unified = switches.kv_unified
        if unified is not None:
            layout = "unified" if unified else "split"
        self._auto = layout == "auto" and n_slots > 1
        self.speculative = speculative
        self.layout_why = ""  # what _choose_layout decided, and why
        self.pad: bool | None = pad if pad is not None else switches.batch_pad  # None: by cost
        self.prefill_chunk = max(1, int(prefill_chunk))
        self.ms: SeqBackend
        if own_context:
            self.ms = OwnContext(engine.target, engine.after_target_decode)
            self.drafts = self.xvocab = None
            self._own_draft = OwnContext(engine.draft) if engine.draft is not None else None
            self.states = None  # the target's sync keeps its prompt states (engine.prompt_cache)
            self._exact: ProbeResult | None = ALONE
        else:
            from localspec.llama.multiseq import MultiSeq

            self.ms = MultiSeq(engine.target, n_slots, unified=layout == "unified")
            self.drafts = BatchDraft.for_engine(engine, n_slots, unified=self.ms.unified,
                                                chunk=self.prefill_chunk)  # the draft model, or None
            self.xvocab = CrossVocabSlots.for_engine(engine, n_slots)  # a draft model of another vocabulary, or None
            # the store of prompt states (core/prompt_cache.py: the server's ServerStates), or None: the engine's
            self.states = getattr(engine.prompt_cache, "store", None)
            self._exact = None
        self.heads = BatchHeads(engine, self.ms)  # the slots' draft heads
        self.n_slots = n_slots
        self.n_ctx = self.ms.n_ctx
        self.runs: list[_Run | None] = [None] * n_slots
        self.lookups: list[PromptLookupDrafter | None] = [None] * n_slots
        self.ngrams: list[NgramCacheDrafter | None] = [None] * n_slots
        self.suffixes: list = [None] * n_slots  # each slot's suffix drafter, over the process's shared corpus
        self.controller_state: dict = {}
        self._curve: dict[int, float] | None = None  # the target's T(b)/T(1), once asked for
        self._ratios: dict[tuple, dict[int, float]] = {}  # (generating slots, unified) -> a slot's verify prices
        self._prefill_rate: float | None = None  # prompt rows decoded per second, measured (_prefill_limit)
        self._decoding_since = 0.0  # when the step's decode began (alone, a step's cost is its wall time)
        self.steps = 0  # batched decodes so far
        self.rows = 0  # rows in them
        self._states_key = ""
        self._track_cold()

    @property
    def draft_seqs(self):
        """The draft model's sequences (its rollback kind, each slot's rollback counters), or None."""
        if self.alone:
            return self._own_draft
        return self.drafts if self.drafts is not None else self.xvocab

    # ------------------------------------------------------------ what runs here
    @property
    def active(self) -> int:
        return sum(r is not None for r in self.runs)

    @property
    def free(self) -> int:
        return self.n_slots - self.active

    def single_reason(self, cfg: GenConfig) -> str:
        """Why `cfg` cannot share this batch's passes and runs alone on the target's own context ('' when it can;
        always alone there): a draft model whose state cannot be rolled back drafts only on its own context."""
        method = self.engine.resolve_method(cfg)
        if self.alone or method != "draft" or not speculates(cfg, method):
            return ""
        return batch_draft_reason(self.engine)

    # ------------------------------------------------------------ join
    def add(self, prompt_tokens: Sequence[int], cfg: GenConfig | None = None,
            cancel: threading.Event | None = None, sink: Callable | None = None) -> int:
        """Start a request in a free slot (the one whose cache shares the longest prefix with the prompt).
        `sink(event)` gets its Pieces and then its Finished, from step(). Returns the slot. Alone, the prompt is
        decoded here (and the first token emitted); in a slot, by the next steps, a chunk a step."""
        cfg = cfg or GenConfig()
        if self._exact is None:
            self.probe()  # clears the caches: only ever before the first request
        if self.single_reason(cfg):
            raise UsageError(self.single_reason(cfg))
        prompt = check_prompt(prompt_tokens, self.n_ctx, cfg.max_tokens)
        bias = check_bias(cfg, self.target.n_vocab)  # nothing left to say: the request's error, before any work
        free = [s for s, r in enumerate(self.runs) if r is None]
        if not free:
            raise UsageError("no free slot")
        exact = self.exactness_for(cfg, cancel)  # may probe (clears caches): before the prefix is chosen
        k, level, why = exact
        seq = self._choose_slot(prompt, free)
        if self.alone:  # the Engine's drafters; the prompt's prefix is the target's sync's (_start_alone)
            policy, label, k = self.engine.make_policy(cfg, exact)
            common, source, note = 0, "", ""
            roll0 = self._rollback_counters(seq)  # after a first request's calibration of the verify curve
        else:
            roll0 = self._rollback_counters(seq)  # the prefix's restore is this request's, as alone
            common, source = self._take_prefix(seq, prompt)
            policy, label, note = self._slot_policy(seq, cfg, k, prompt, common)
        stats = new_stats(cfg, label, k, level, why)
        stats.rpc_workers = list(self.target.rpc_servers)
        stats.reason = "; ".join(x for x in (stats.reason or self.engine.rollback_notice(cfg), note) if x)
        stats.rollback = self.ms.rollback_kind
        if "draft" in policy.drafters and self.draft_seqs is not None:
            stats.draft_rollback = self.draft_seqs.rollback_kind
        stats.prompt_tokens = len(prompt)
        stats.cached_prompt_tokens = common
        stats.prompt_cache = source or ("memory" if common else "")  # a slot's cache: this process's memory
        t0 = stats.started = time.perf_counter()
        stats.running = True
        prefill = [] if self.alone else prompt[common:]
        run = self.runs[seq] = _Run(seq, prefill, self.target, prompt, cfg, policy, stats, bias=bias,
                                    sink=sink or (lambda ev: None), cancel=cancel, t0=t0)
        run.roll0 = roll0
        try:
            if self.alone:
                self._start_alone(run)
            else:
                self._start_in_slot(run, common)
        except BaseException:  # a decode error, an interrupt: the slot is free again, the stats final
            self._settle(run)
            raise
        return seq

    def _take_prefix(self, seq: int, prompt: list[int]) -> tuple[int, str]:
        """Slot `seq` made to hold the longest prefix of `prompt` it can have without decoding: its own cache's,
        another slot's, or a kept state's. Returns (its length, where it came from: "disk", "memory" or "")."""
        common = self.ms.take_prefix(seq, prompt)  # its own cache's, or another slot's
        common, source = self._restore(seq, prompt, common)  # or a kept state of a longer prefix
        if common == len(prompt):  # the last prompt token is decoded again for its logits
            common = self.ms.reachable(seq, common - 1)  # a recurrent state: where it rolls back without a replay
        self.ms.truncate(seq, common)
        return common, source

    def _slot_policy(self, seq: int, cfg: GenConfig, k: int, prompt: list[int], common: int):
        """(policy, method label, a note for its stats' reason) of a request in slot `seq`: the slot's drafters (kept in the slot from request to
        request), and the controller memory the batch's requests share. What a verify of b rows costs is set each
        step by _price_rows (the whole batch's passes on the calibrated curve); its live T(1) is the slot's share of
        a step."""
        method = self.engine.resolve_method(cfg)
        drafters = drafters_for(cfg, method, SlotPool(self, seq, prompt, common)) if k > 0 else {}
        policy, label = build_policy(cfg, method if drafters else "none", k, drafters, self.controller_state)
        note = ""
        if method == "auto" and label != "none" and not set(policy.drafters) - {"lookup", "ngram", "suffix"}:
            note = "batched: auto speculates with prompt lookup, the n-gram cache and the suffix cache"
        return policy, label, note

    def _start_alone(self, run: _Run) -> None:
        """The request's prompt decoded on the target's own context by the Engine's sync (what the cache holds is
        reused; with a prompt cache a stored prefix state is restored first), its drafters told, its first token
        emitted."""
        engine, target, prompt, stats = self.engine, self.target, run.context, run.stats
        engine.attach(run.policy.drafters.values(), run.text, stats)
        if "draft" in run.policy.drafters:
            engine.restore_draft_state(prompt)  # the prompt cache's state of the draft model, where it has one
        target.cancel_event = run.cancel  # a long prompt stops between chunks when the caller gives up
        try:
            logits, cached, source = engine.sync_prompt(prompt, shared_upto=run.cfg.shared_upto)
        except DecodeCancelled:
            stats.cached_prompt_tokens = common_prefix(target.tokens, prompt)
            stats.prompt_s = time.perf_counter() - run.t0
            run.end("cancelled")  # the step releases it: Finished, no tokens
            return
        finally:
            target.cancel_event = None
        stats.cached_prompt_tokens, stats.prompt_cache = cached, source
        for d in run.policy.drafters.values():
            d.begin(prompt)
        engine.after_target_decode(*target.last_replay)
        engine.after_target_decode(prompt[cached:], cached)
        stats.prompt_s = time.perf_counter() - run.t0
        run.guarded(run.start, logits)

    def _start_in_slot(self, run: _Run, common: int) -> None:
        """The request's drafters told; its prompt's rest is decoded by the next steps, and the state of its prefix
        is kept where the slot decodes it as a cold prefill (_save)."""
        prompt = run.context
        for drafter in run.policy.drafters.values():
            drafter.begin(prompt)
        run.keep = self._keep_point(run.seq, prompt, common)

    def _rollback_counters(self, seq: int) -> tuple[dict, dict | None]:
        """Slot `seq`'s rollback counters on the target's and the draft model's sequences (take differences)."""
        drafts = self.draft_seqs
        return self.ms.rollback_counters(seq), (drafts.rollback_counters(seq) if drafts is not None else None)

    def _choose_slot(self, prompt: list[int], free: list[int]) -> int:
        """The free slot for a new request: the one whose cache shares the longest prefix with the prompt when that
        saves at least REUSE_MIN prompt tokens (a continued chat); else the one that keeps the active slots
        consecutive (llama.cpp passes take only consecutive sequences: active slots 0 and 2 cost two passes a
        step), the lowest such."""
        common = {s: common_prefix(self.ms.tokens[s], prompt) for s in free}
        best = max(free, key=lambda s: common[s])
        if common[best] >= min(REUSE_MIN, len(prompt) - 1) and common[best] > 0:
            return best
        active = {s for s, r in enumerate(self.runs) if r is not None}

        def runs_with(s: int) -> int:
            on = active | {s}
            return sum(1 for x in on if x - 1 not in on)

        return min(free, key=lambda s: (runs_with(s), s))

    # ------------------------------------------------------------ one step
    def step(self) -> int:
        """One batched decode over every active slot; events go to the slots' sinks. Returns the rows decoded."""
        for run in self._live():
            if run.cancel is not None and run.cancel.is_set():
                run.end("cancelled")
        ms = self.ms
        budget = ms.n_batch
        gen = [r for r in self._live() if not r.prefill]
        if not self.alone:  # alone, a verify is priced by the target's own verify curve (the policy reads it)
            self._price_rows(len(gen))
        budget -= len(gen)  # one row each for the pending tokens
        parts, owners, chosen = [], [], []
        for run in gen:
            plan = run.plan(room=self.n_ctx - len(ms.tokens[run.seq]) - 1, budget=budget)
            if plan is None:  # out of tokens or room
                budget += 1
                continue
            budget -= plan[1]  # held for its drafts; what the drafter leaves unused comes back below
            chosen.append((run, *plan))
        shared = self.drafts.draft(chosen) if self.drafts is not None else {}  # the draft model: all slots at once
        for run, drafter, k in chosen:
            toks = run.propose(drafter, k, shared.get(run.seq, 0.0))
            budget += k - (len(toks) - 1)
            run.step.base = len(ms.tokens[run.seq])
            parts.append((run.seq, toks, range(len(toks))))
            owners.append(run)
        limit = self._prefill_limit() if parts else self.prefill_chunk  # smaller beside generating requests
        for run in self._live():
            if not run.prefill or budget <= 0:
                continue
            n = min(len(run.prefill), limit, budget)
            chunk = run.prefill[:n]
            last = n == len(run.prefill)
            budget -= n
            run.step = None
            parts.append((run.seq, chunk, [n - 1] if last else []))
            owners.append(run)
        if not parts:
            self._release_finished()
            return 0
        self._pad(parts, owners)
        total = 0
        for group in self._apart(parts, owners):
            total += self._decode(*group)
        self._release_finished()
        return total

    def _prefill_limit(self) -> int:
        """Prompt tokens a joining request decodes in a step where other requests are generating: prefill_chunk,
        or fewer where this machine prefills so slowly that the chunk would hold the others' next token back for
        more than PREFILL_STEP_S (a slow CPU's whole chunk stalls running answers for seconds). From the prefill
        rate measured on earlier chunks; alone, a prompt takes the whole chunk."""
        if not self._prefill_rate:
            return self.prefill_chunk
        return max(PREFILL_MIN, min(self.prefill_chunk, int(self._prefill_rate * PREFILL_STEP_S)))

    def _decode(self, parts: list, owners: list) -> int:
        """One llama_decode of `parts` (rows of the slots in `owners`), verified and prefilled. Returns its rows."""
        self._note_shapes(parts, owners)
        total = sum(len(p[1]) for p in parts)
        t0 = self._decoding_since = time.perf_counter()
        outs = self.ms.decode(parts, copy=False)  # used before the next decode
        dt = time.perf_counter() - t0
        hooks = self.heads.after_decode(parts)  # the heads read the slots' hidden states before the next decode
        self.steps += 1
        self.rows += total
        prompt_rows = sum(len(p[1]) for p, run in zip(parts, owners) if run.step is None)
        if prompt_rows >= PREFILL_MIN and dt > 0:  # the prefill rate here (rows of generating requests included)
            rate = total / dt
            self._prefill_rate = rate if self._prefill_rate is None else 0.5 * (self._prefill_rate + rate)
        for run, part, rows in zip(owners, parts, outs):
            share = dt * len(part[1]) / total + hooks.get(run.seq, 0.0)  # this request's part of the step's cost
            if run.step is None:
                self._prefilled(run, part[1], rows, share)
            else:
                self._verified(run, rows, share, dt / total)
        # the step's rollbacks that restored a checkpoint: their replays, every slot's in one decode
        self.ms.flush()
        if self.drafts is not None:
            self.drafts.flush()
        return total

    def _release_finished(self) -> None:
        for run in self.runs:
            if run is not None and run.finish is not None:
                self._release(run)

    def _live(self) -> list[_Run]:
        return [r for r in self.runs if r is not None and r.finish is None]

    def _prefilled(self, run: _Run, chunk, rows, share: float) -> None:
        del run.prefill[:len(chunk)]
        if run.keep:
            self._save(run)
        if run.prefill:
            return
        run.stats.prompt_s = time.perf_counter() - run.t0
        run.guarded(run.start, rows[0])

    def _verified(self, run: _Run, rows, share: float, per_row: float) -> None:
        # past the drafts' rows: padding (_pad), rolled back with the rejected rows
        def cut(n: int) -> float:
            """Roll back; what the replay it leaves (a recurrent state's restore) will cost, at this decode's time
            per row: the step's flush decodes it, and the slot's controller counts it. Alone, the replay is made
            here, inside the step's wall time."""
            self.ms.truncate(run.seq, n)
            return per_row * self.ms.pending(run.seq)

        if self.alone:  # nothing shares the step: its cost is its wall time since the decode began
            run.guarded(run.verified, rows, cut, t_start=self._decoding_since)
        else:
            run.guarded(run.verified, rows, cut, share=share)

    def _release(self, run: _Run) -> None:
        self._settle(run)
        run.close()
        if self.alone and "draft" in run.policy.drafters:  # the draft model's prompt state, once it caught up
            self.engine.save_draft_state(run.context[:run.stats.prompt_tokens], shared_upto=run.cfg.shared_upto)

    def _settle(self, run: _Run) -> None:
        """The request leaves its slot: its final figures and the rollbacks it caused (also after an interrupt or
        an error). Alone, its verify steps' judgements of the target's curve are kept with the calibration."""
        if self.runs[run.seq] is not run:
            return
        self.runs[run.seq] = None
        self.heads.release(run.seq)
        run.settle()
        if self.alone:
            self.engine.note_verify_steps(run.policy)
        (t0, d0), (t1, d1) = run.roll0, self._rollback_counters(run.seq)
        run.stats.add_rollback(t0, t1, d0, d1)

    def fail_all(self) -> list[_Run]:
        """Drop every active request (after an error in a step); their caches are cleared. Returns them."""
        dropped = [r for r in self.runs if r is not None]
        self.runs = [None] * self.n_slots
        self.ms.clear()
        self.heads.clear()
        if self.drafts is not None:
            self.drafts.clear()
        if self.xvocab is not None:
            self.xvocab.close()  # made again at the next draft
        return dropped

    # ------------------------------------------------------------ helpers
    def submit(self, prompt_tokens: Sequence[int], cfg: GenConfig | None = None,
               cancel: threading.Event | None = None) -> Response:
        """add() with a Response handle as the request's sink: step() feeds it (listen() passes events on)."""
        joined: list[_Run] = []
        resp = Response(stats=lambda: joined[0].stats if joined else None,
                        held=lambda: joined[0].text.held() if joined else "")
        joined.append(self.runs[self.add(prompt_tokens, cfg, cancel, sink=resp.push)])
        return resp

    def events(self, prompt_tokens: Sequence[int], cfg: GenConfig | None = None,
               cancel: threading.Event | None = None) -> Iterator[Piece | Finished]:
        """One request stepped to its end: its Pieces, then its Finished (or its error, raised after the tokens
        emitted before it). Stopping early (an interrupt, a closed iterator) leaves the stats final and the slot
        free."""
        events: deque = deque()
        seq = None
        try:
            seq = self.add(prompt_tokens, cfg, cancel, sink=events.append)
            while True:
                while events:
                    ev = events.popleft()
                    if isinstance(ev, Exception):
                        raise ev
                    yield ev
                if not self.active:
                    return
                self.step()
        finally:
            if seq is not None and self.runs[seq] is not None:
                self._settle(self.runs[seq])

    def generate_all(self, requests: Sequence[tuple[Sequence[int], GenConfig]]) -> list[Finished]:
        """Run requests together (all joining at once) until they end; their Finished, in order (tests)."""
        responses: list[Response | None] = [None] * len(requests)
        pending = list(enumerate(requests))
        while pending or self.active:
            while pending and self.free:
                i, (prompt, cfg) = pending.pop(0)
                responses[i] = self.submit(prompt, cfg)
            self.step()
        return [r.result() for r in responses]

    def close(self) -> None:
        self.heads.close()
        self.ms.close()
        if self.drafts is not None:
            self.drafts.close()
        if self.xvocab is not None:
            self.xvocab.close()

