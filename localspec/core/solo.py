"""A batch of one: the scheduler (core/batch.py's BatchEngine.step) over the target's own context.

`run`, `chat` and `bench` decode one request at a time. They run through the same step as `serve --parallel N`
(plan every live generation, draft, one llama_decode, verify, emit, release), with a backend of one sequence: the
target's own single-sequence context and the Engine's own drafters, whose state outlives the request (a draft
model's cache, the heads on the target's context, the adaptive controller's memory, the prompt's reused prefix).

What differs from a slot of a batch, and why:
- the prompt is decoded at once by the target's `sync` (prefix reuse, a recurrent state's checkpoint), not in
  chunks: nothing else waits beside it; with a prompt cache (core/prompt_cache.py) a stored prefix state is restored
  first and the prefill stops once at its save point to keep that prefix's state;
- exactness is the Engine's answer (verify widths only: no other request ever shares a pass), so there is no batch
  probe and no pass shape to note;
- a verify is priced by the target's own verify curve (the policy reads it), and a step's cost is its wall time,
  the replay of a rollback included, as nothing else shares it;
- every target decode is handed to the Engine's drafters (Engine._after_decode: heads read the hidden states).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Iterator, Sequence

from localspec.core.batch import BatchEngine, _Run
from localspec.core.config import GenConfig
from localspec.core.exactness import ProbeCancelled
from localspec.core.generation import Finished, Piece, check_bias, check_prompt, new_stats
from localspec.errors import DecodeCancelled
from localspec.seq import common_prefix


class _OneSeq:
    """What the step reads of its sequences' caches, for the target's own context (sequence 0)."""

    unified = False

    def __init__(self, target) -> None:
        self.target = target

    @property
    def tokens(self) -> list[list[int]]:
        return [self.target.tokens]

    @property
    def n_batch(self) -> int:
        return self.target.n_batch


def rollback_counters_of(model) -> dict | None:
    counters = getattr(model, "rollback_counters", None)
    return counters() if counters is not None else None


class SoloEngine(BatchEngine):
    """One request on `engine`'s target context, stepped by BatchEngine.step. Made per request (cheap): what must
    outlive a request lives on the Engine."""

    def __init__(self, engine) -> None:  # noqa: D107 - none of BatchEngine's slots, probes or batch drafters
        self.engine = engine
        self.target = engine.target
        self.ms = _OneSeq(engine.target)
        self.n_slots = 1
        self.n_ctx = engine.target.n_ctx
        self.runs: list[_Run | None] = [None]
        self.drafts = None
        self.pad = False
        self.prefill_chunk = max(1, engine.target.n_batch)
        self._prefill_rate = None
        self.steps = 0
        self.rows = 0

    # ------------------------------------------------------------ join
    def add(self, prompt_tokens: Sequence[int], cfg=None, cancel: threading.Event | None = None,
            sink: Callable | None = None) -> int:
        """Start the request: its checks, exactness, policy and stats as Engine sets them, then its prompt decoded
        (what the cache already holds is reused) and its first token emitted to `sink`."""
        engine, target = self.engine, self.target
        cfg = cfg or GenConfig()
        prompt = check_prompt(prompt_tokens, target.n_ctx, cfg.max_tokens)
        bias = check_bias(cfg, target.n_vocab)  # nothing left to say: the request's error, before any work
        try:
            exact = engine.exactness_for(cfg, cancel)
        except ProbeCancelled:  # the caller gave up while the exactness probe ran: plain, then "cancelled"
            exact = (0, "bit", "bit: the exactness probe was cancelled")
        _, level, why = exact
        policy, method, k_cap = engine.make_policy(cfg, exact)
        engine._hooked = list(policy.drafters.values())
        stats = engine.last_stats = new_stats(cfg, method, k_cap, level, why)
        stats.rpc_workers = list(getattr(target, "rpc_servers", None) or [])
        stats.reason = stats.reason or engine.rollback_notice(cfg)
        stats.rollback = getattr(target, "rollback_kind", "kv")
        if engine.draft is not None and "draft" in policy.drafters:
            stats.draft_rollback = getattr(engine.draft, "rollback_kind", "kv")
        stats.prompt_tokens = len(prompt)
        t0 = stats.started = time.perf_counter()
        run = _Run(0, [], target, prompt, cfg, policy, stats, bias=bias, sink=sink or (lambda ev: None),
                   cancel=cancel, t0=t0)
        run.roll0 = (rollback_counters_of(target), rollback_counters_of(engine.draft))
        engine._assembler = run.text
        stats.running = True
        self.runs[0] = run
        if "draft" in policy.drafters:
            engine.restore_draft_state(prompt)  # the prompt cache's state of the draft model, where it has one
        target.cancel_event = cancel  # a long prompt stops between chunks when the caller gives up
        try:
            logits, cached, source = engine.sync_prompt(prompt)
        except DecodeCancelled:
            stats.cached_prompt_tokens = common_prefix(target.tokens, prompt)
            stats.prompt_s = time.perf_counter() - t0
            run.end("cancelled")  # the step releases it: Finished, no tokens
            return 0
        finally:
            target.cancel_event = None
        stats.cached_prompt_tokens, stats.prompt_cache = cached, source
        for d in engine._hooked:
            d.begin(prompt)
        engine._after_decode(*getattr(target, "last_replay", ((), 0)))
        engine._after_decode(prompt[cached:], cached)
        stats.prompt_s = time.perf_counter() - t0
        run.guarded(run.start, logits)
        return 0

    # ------------------------------------------------------------ the step's backend
    def _price_rows(self, n: int) -> None:
        """Nothing to price beside: the policy reads the target's own verify curve."""

    def _decode(self, parts: list, owners: list) -> int:
        """The step's one part: the request's pending token and drafts, decoded on the target's context with logits
        at every row, handed to the Engine's drafters, verified."""
        ((_, toks, _),), (run,) = parts, owners
        engine, target = self.engine, self.target
        tv = time.perf_counter()
        base = len(target.tokens)
        rows = target.decode(toks, "all", copy=False)  # used before the next decode
        engine._after_decode(toks, base)

        def truncate(n: int) -> None:
            replay = target.truncate(n)  # recurrent/hybrid: may decode accepted tokens again
            if replay:
                engine._after_decode(replay, target.last_replay[1])

        run.guarded(run.verified, rows, truncate, t_start=tv)
        self.steps += 1
        self.rows += len(toks)
        return len(toks)

    def _release(self, run: _Run) -> None:
        self._settle(run)
        run.close()
        if "draft" in run.policy.drafters:  # the draft model's prompt state, once it caught up (the prompt cache)
            self.engine.save_draft_state(run.context[:run.stats.prompt_tokens])

    def _settle(self, run: _Run) -> None:
        """The request leaves: its final figures and the rollbacks it caused (also after an interrupt or error)."""
        if self.runs[0] is not run:
            return
        self.runs[0] = None
        run.settle()
        self.engine.note_verify_steps(run.policy)
        (t0, d0) = run.roll0
        run.stats.add_rollback(t0, rollback_counters_of(self.target), d0, rollback_counters_of(self.engine.draft))

    # ------------------------------------------------------------ the caller's side
    def events(self, prompt_tokens: Sequence[int], cfg=None,
               cancel: threading.Event | None = None) -> Iterator[Piece | Finished]:
        """Step the request to its end: its Pieces, then its Finished (or its error, raised after the tokens emitted
        before it). Stopping early (an interrupt, a closed iterator) leaves the stats final and the slot free."""
        events: deque = deque()
        try:
            self.add(prompt_tokens, cfg, cancel, sink=events.append)
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
            if self.runs[0] is not None:
                self._settle(self.runs[0])
