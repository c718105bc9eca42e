"""Continuous batching: several generations decoded together over one target, with speculation per request.

N slots, one llama.cpp sequence each (llama/multiseq.py). A step gathers every active slot's rows into ONE
llama_decode: a generating slot's pending token and drafts, a joining slot's prompt chunk (at most `prefill_chunk`
tokens, fewer beside generating slots on a slow machine). Each request is a core/generation.py Generation, as in a
batch of one (core/solo.py: the same step over the target's own context, what `run` and `chat` use), so grammars,
logprobs and logit_bias batch like any request. A draft head (EAGLE-3, DFlash, DSpark, MTP) drafts in its slot from
that slot's rows of each batched decode (core/batch_heads.py); a draft model of another vocabulary drafts per slot
on its own sequence (core/batch_xvocab.py).
Invariant per slot, as in a batch of one: the slot's sequence holds every context token but the pending one.
A recurrent/hybrid target (or draft model) rolls each slot back on its own (llama/multiseq.py: a plane, or the
slot's checkpoint and a replay); the replays of a step are decoded together after its verify, and each request's
stats count its slot's restores and replayed tokens, as a batch of one's do.

Rules, and why (docs/design.md, "Batching", has the measurements behind them):
- a slot's controller is timed by its share of the step and prices a verify of b rows by what it adds to the
  whole step (`_price_rows`, core/batch_shape.py), so k per request follows from the cost of the batch;
- a row's logits can depend on the other rows of its forward pass, so the probe (core/exactness.probe_batch)
  checks every pass shape a bit request can be in; a bit request stays bit while it shares only passes that
  matched, and from the first that did not it runs at lossless, its stats saying from which token and why;
- one pass per step where that pays: slots padded to the step's most rows (`_pad`), new requests placed to keep
  active slots consecutive (llama.cpp passes take consecutive sequences), a slot whose cache shares REUSE_MIN
  prompt tokens taken first;
- prompt states (core/prompt_cache.py, the server's store): a request restores the longest kept state of its
  prompt's start that no slot holds, from memory or disk, and a slot's state is kept at the prompt's last multiple
  of the chunk (`_save`) where the slot decoded it as a cold prefill here does (whole chunks from 0, each alone in
  its llama_decode: MultiSeq.cold). So a restored prefix holds the bytes the same prompt decoded alone gives, the
  rest is decoded as it then would be, and the request's exactness is that of the same request without the cache.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Sequence


from localspec import defaults as D
from localspec.core.batch_draft import BatchDraft, batch_draft_reason
from localspec.core.batch_xvocab import CrossVocabSlots
from localspec.core.batch_heads import BatchHeads
from localspec.core.config import GenConfig
from localspec.core import exactness as X
from localspec.core.batch_shape import PassShapes
from localspec.core.exactness import ProbeResult
from localspec.core.generation import Finished, Generation, check_bias, check_prompt, new_stats
from localspec.core.policy import build_policy
from localspec.core.response import Response
from localspec.drafters import PromptLookupDrafter, chained
from localspec.drafters.ngram_cache import NgramCacheDrafter
from localspec.drafters.grammar import GrammarDrafter
from localspec.errors import UsageError
from localspec.knobs import knobs
from localspec.seq import common_prefix

PREFILL_CHUNK = 256  # prompt tokens a joining request decodes per step
PREFILL_STEP_S = 3.0  # ... at most this long beside generating requests, by the measured prefill rate
PREFILL_MIN = 16  # ... and never fewer than this many
REUSE_MIN = 16  # cached prompt tokens that make a new request take that slot (else: keep active slots consecutive)


class _Run(Generation):
    """One request in a slot: its Generation, the slot's sequence, and the prompt tokens not decoded yet."""

    def __init__(self, seq: int, prefill: list[int], *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.seq = seq
        self.prefill = prefill
        self.roll0: tuple[dict, dict | None] = ({}, None)  # the slot's rollback counters when it joined
        self.keep: list[int] = []  # the prompt's prefix whose state is kept once the slot holds it (_save)


class BatchEngine(PassShapes):
    """N slots over `engine`'s target (a core.engine.Engine). Not thread-safe: one thread calls add() and step()."""

    def __init__(self, engine, n_slots: int, *, prefill_chunk: int = PREFILL_CHUNK,
                 unified: bool | None = None, pad: bool | None = None, layout: str = "split",
                 speculative: bool = True) -> None:
        """layout: "split" (one KV stream per slot), "unified" (one KV cache for all slots) or "auto" (split until
        the probe; then unified where a full batch is not bit-identical anyway and `speculative`, see
        _choose_layout). unified (True/False) or LOCALSPEC_KV_UNIFIED=1/0 overrides it. pad: pad a step's slots to
        one pass (_pad; default by cost, LOCALSPEC_BATCH_PAD=1/0 forces it)."""
        from localspec.llama.multiseq import MultiSeq

        if n_slots < 1:
            raise UsageError(f"need at least one slot, got {n_slots}")
        if layout not in D.KV_LAYOUTS:
            raise UsageError(f"the KV layout must be one of {', '.join(D.KV_LAYOUTS)}, got {layout!r}")
        self.engine = engine
        self.target = engine.target
        switches = knobs()
        if unified is None:
            unified = switches.kv_unified
        if unified is not None:
            layout = "unified" if unified else "split"
        self._auto = layout == "auto" and n_slots > 1
        self.speculative = speculative
        self.layout_why = ""  # what _choose_layout decided, and why
        self.ms = MultiSeq(engine.target, n_slots, unified=layout == "unified")
        self.pad: bool | None = pad if pad is not None else switches.batch_pad  # None: by cost
        self.prefill_chunk = max(1, int(prefill_chunk))
        self.drafts = BatchDraft.for_engine(engine, n_slots, unified=self.ms.unified,
                                            chunk=self.prefill_chunk)  # the draft model, or None
        self.xvocab = CrossVocabSlots.for_engine(engine, n_slots)  # a draft model of another vocabulary, or None
        self.heads = BatchHeads(engine, self.ms)  # the slots' draft heads
        self.n_slots = n_slots
        self.n_ctx = self.ms.n_ctx
        self.runs: list[_Run | None] = [None] * n_slots
        self.lookups: list[PromptLookupDrafter | None] = [None] * n_slots
        self.ngrams: list[NgramCacheDrafter | None] = [None] * n_slots
        self.suffixes: list = [None] * n_slots  # each slot's suffix drafter, over the process's shared corpus
        self.controller_state: dict = {}
        self._exact: ProbeResult | None = None
        self._curve: dict[int, float] | None = None  # the target's T(b)/T(1), once asked for
        self._ratios: dict[tuple, dict[int, float]] = {}  # (generating slots, unified) -> a slot's verify prices
        self._prefill_rate: float | None = None  # prompt rows decoded per second, measured (_prefill_limit)
        self.steps = 0  # batched decodes so far
        self.rows = 0  # rows in them
        # the store of prompt states (core/prompt_cache.py: the server's ServerStates), or None: the engine's
        self.states = getattr(getattr(engine, "prompt_cache", None), "store", None)
        self._states_key = ""
        self._track_cold()

    # ------------------------------------------------------------ prompt states
    @property
    def state_chunk(self) -> int:
        """The chunk a joining prompt is decoded in when nothing else runs (what a kept state's prefix is made of)."""
        return min(self.prefill_chunk, self.ms.n_batch)

    def _track_cold(self) -> None:
        self._states_key = ""
        self.ms.cold_chunk = self.state_chunk if self._keeps_states() else 0

    def _keeps_states(self) -> bool:
        from localspec.core.prompt_cache import usable

        return self.states is not None and usable(self.target) and not self.ms.recurrent

    def _key(self) -> str:
        if not self._states_key:
            from localspec.core.prompt_cache import batch_key

            self._states_key = batch_key(self.target, self.state_chunk, self.ms.unified)
        return self._states_key

    def _restore(self, seq: int, prompt: list[int], common: int) -> tuple[int, str]:
        """Slot `seq` holding `common` tokens of `prompt` (its own or another slot's): the longest kept state of a
        longer prefix (never the whole prompt: its last token is decoded for logits) restored into it. Returns
        (the prompt tokens the slot holds, where the state came from: "memory" or "disk"; "" when none was
        restored)."""
        if not self._keeps_states() or len(prompt) < 2:
            return common, ""
        from localspec.core.prompt_cache import find

        if self.ms.cold_chunk != self.state_chunk:
            self._track_cold()
        try:
            hit = find(self.states, self._key(), prompt[:-1], longer_than=common)
        except OSError:
            return common, ""
        if hit is None:
            return common, ""
        n, data, source = hit
        if n % self.state_chunk == 0 and self.ms.restore_state(seq, prompt[:n], data, cold=True):
            return n, source
        return self.ms.take_prefix(seq, prompt), ""  # refused: the slot is empty now; what another slot has

    def _save(self, run: "_Run") -> None:
        """Keep slot run.seq's state where its prompt's save point was just reached as a cold prefill here (the
        store has none of it yet)."""
        from localspec.core.prompt_cache import has

        keep, seq = run.keep, run.seq
        a = len(keep)
        if not a or len(self.ms.tokens[seq]) != a or self.ms.cold[seq] < a:
            return
        run.keep = []
        key = self._key()
        try:
            if has(self.states, key, keep):
                return
            data = self.ms.state_of(seq)
            if data:
                self.states.put(key, keep, data, label=self.target.name)
        except OSError:
            pass

    # ------------------------------------------------------------ what runs here
    @property
    def active(self) -> int:
        return sum(r is not None for r in self.runs)

    @property
    def free(self) -> int:
        return self.n_slots - self.active

    def single_reason(self, cfg: GenConfig) -> str:
        """Why `cfg` takes the single-sequence Engine instead of a slot ('' when it can be batched)."""
        method = self.engine.resolve_method(cfg)
        if cfg.k > 0 and self.heads.reason(method):
            return self.heads.reason(method)
        if method == "draft" and cfg.k > 0 and batch_draft_reason(self.engine):
            return batch_draft_reason(self.engine)
        return ""

    def probe(self, cache: bool = False) -> tuple[bool, str]:
        """(exact, why): whether a sequence's logits stay bit-identical when other sequences' rows share its
        forward passes, and one-token decoding here equals the target's own context. Once per BatchEngine; clears
        the slots' caches and the target's single-sequence cache (call it before the first request). cache: see
        probe_result."""
        return self.probe_result(cache).verdict

    @property
    def layout(self) -> str:
        """Where the slots' KV lives: "unified", "split", or "auto" while the probe has not chosen yet."""
        if self._auto and self._exact is None:
            return "auto"
        return "unified" if self.ms.unified else "split"

    def probe_result(self, cache: bool = False) -> ProbeResult:
        """The probe's findings: the verdict, and per pass shape (requests x rows each) whether it is bit-exact.
        cache: the verdict is kept in the cache dir per model file, llama.cpp build and batch settings
        (_probe_key), so a server started again answers its first request without seconds of probe decodes."""
        if self._exact is None:
            res = self._cached_probe() if cache else self._probe()
            res = res if isinstance(res, ProbeResult) else ProbeResult(*res)
            self._exact = self._choose_layout(res) if self._auto else res
        return self._exact

    def _probe_key(self) -> str:
        """What decides the probe's verdict besides the model and the build: the slots, the rows a bit request
        verifies, the pass size, the cache layout and size, a recurrent state's rollback (its planes change how
        llama.cpp splits a batch into passes), and the probe's revision (raised when _probe checks more, so a
        verdict of a probe that checked less is not trusted)."""
        rollback = [f"rollback={self.ms.rollback_kind}:{self.ms.rs_seq}"] if self.ms.recurrent else []
        return X.batch_probe_key(self.target, f"rev={X.BATCH_REV}", f"slots={self.n_slots}", f"rows={self.bit_rows()}",
                                 f"n_batch={self.ms.n_batch}", f"n_ctx={self.ms.n_ctx}", f"unified={self.ms.unified}",
                                 *rollback)

    def probe_cached(self) -> bool:
        """Whether probe(cache=True) is answered from the cache (or was run already): no probe decodes."""
        return self._exact is not None or X.cached_batch_probe(self._probe_key()) is not None

    def _cached_probe(self) -> ProbeResult:
        key = self._probe_key()
        res = X.read_batch_probe(key)
        if res is None:
            res = self._probe()
            res = res if isinstance(res, ProbeResult) else ProbeResult(*res)
            X.write_batch_probe(key, res, self.target, self.n_slots)
        return res

    def calibrate(self) -> None:
        """The target's verify-cost curve that every step's pricing reads (_price_rows): measured once per model
        and build (cached), here rather than in the first request's first step."""
        self._calibrated()

    def _choose_layout(self, res: ProbeResult) -> ProbeResult:
        """layout auto, after the probe over separate streams: one unified KV cache where a full batch (every slot
        x 1 row) is not bit-identical here anyway, so a request sharing its steps with the others runs at lossless
        whichever the layout, and where requests draft (`speculative`). Then every step is ONE forward pass: over
        separate streams llama.cpp runs a slot's drafted rows as a pass of their own (multiseq.split_equal), which
        on a compute-bound CPU made `auto` slower than plain decoding at 4 clients (docs/design.md). The price: a request alone keeps bit exactness only over separate streams (in one cache, other requests'
        rollbacks leave its cells out of position order), so where a full batch is bit-identical (an F16 model on
        a CPU) or nothing drafts, the streams stay separate; and for a recurrent/hybrid target, whose batches
        llama.cpp splits in passes of equal rows per sequence in either layout (its recurrent cells take one state
        per sequence). Returns the probe result that now holds."""
        n = self.n_slots
        full = res.exact or (not res.blanket and res.shapes.get((n, 1), False))
        if full or not self.speculative or self.ms.recurrent:
            self.layout_why = "separate KV streams: " + (
                f"a full batch of {n} requests is bit-identical here" if full else
                "plain decoding drafts no rows to share a pass" if not self.speculative else
                "a recurrent state splits a step into passes per sequence in one KV cache too")
            return res
        from localspec.llama.multiseq import MultiSeq

        self.ms.close()
        self.ms = MultiSeq(self.target, n, unified=True)
        self._track_cold()
        self.heads.close()
        self.heads = BatchHeads(self.engine, self.ms)
        if self.drafts is not None:
            self.drafts.close()
            self.drafts = BatchDraft.for_engine(self.engine, n, unified=True, chunk=self.prefill_chunk)
        self._ratios.clear()
        self.layout_why = (f"one unified KV cache: a full batch of {n} requests x 1 row is not bit-identical here "
                           "anyway, and in one cache a step's drafted rows join its one forward pass")
        return ProbeResult(False, f"the {n} slots share one KV cache (--kv-layout auto: {res.why}), and after other "
                           "requests' rollbacks a request's cache cells are no longer in position order")

    def bit_rows(self) -> int:
        """The most rows a bit-exact request verifies in one step here (the engine's bit k cap + 1)."""
        return self.engine.exact_k(X.PROBE_MIN_UPTO - 1) + 1

    def _probe(self) -> ProbeResult:
        """The probe of several requests in one pass (exactness.probe_batch) on this batch's slots."""
        return X.probe_batch(self.ms, self.target, self.n_slots, self.bit_rows())

    def exactness_for(self, cfg: GenConfig) -> tuple[int, str, str]:
        """(k, level, why) for a batched request: Engine's answer; at lossless where batching is never bit-exact
        here; where only some pass shapes are not, at bit until the request shares such a pass (step() says)."""
        k, level, why = self.engine.exactness_for(cfg, rows=self.bit_rows())  # the rows its probe decoded
        if self.engine.resolve_method(cfg) == "none" or cfg.k <= 0:
            k = 0
        if level != "bit":
            return k, level, why
        res = self.probe_result()
        if res.exact:
            return k, level, f"{why}; batched with other requests: {res.why}"
        if not res.blanket:
            return k, level, (f"{why}; batched with other requests it stays bit while it shares only passes that are "
                              f"bit-identical here ({res.why})")
        k = cfg.k if self.engine.resolve_method(cfg) != "none" else 0
        return k, "lossless", (f"lossless: batched with other requests, and {res.why} here; every token is "
                               "still the target's choice in the pass that emitted it")

    # ------------------------------------------------------------ join
    def add(self, prompt_tokens: Sequence[int], cfg: GenConfig | None = None,
            cancel: threading.Event | None = None, sink: Callable | None = None) -> int:
        """Start a request in a free slot (the one whose cache shares the longest prefix with the prompt).
        `sink(event)` gets its Pieces and then its Finished, from step(). Returns the slot."""
        cfg = cfg or GenConfig()
        if self._exact is None:
            self.probe()  # clears the caches: only ever before the first request
        if self.single_reason(cfg):
            raise UsageError(self.single_reason(cfg))
        prompt = check_prompt(prompt_tokens, self.n_ctx, cfg.max_tokens)
        bias = check_bias(cfg, self.target.n_vocab)
        free = [s for s, r in enumerate(self.runs) if r is None]
        if not free:
            raise UsageError("no free slot")
        k, level, why = self.exactness_for(cfg)  # may probe (clears caches): before the prefix is chosen
        seq = self._choose_slot(prompt, free)
        roll0 = self._rollback_counters(seq)  # the prefix's restore is this request's, as in a batch of one
        common = self.ms.take_prefix(seq, prompt)  # its own cache's, or another slot's
        common, source = self._restore(seq, prompt, common)  # or a kept state of a longer prefix
        if common == len(prompt):  # the last prompt token is decoded again for its logits
            common = self.ms.reachable(seq, common - 1)  # a recurrent state: where it rolls back without a replay
        self.ms.truncate(seq, common)
        method = self.engine.resolve_method(cfg)
        drafters = {}
        if method != "none" and k > 0:
            d = self.lookups[seq]
            if d is None or (d.n_min, d.n_max) != (cfg.lookup_min, cfg.lookup_max):
                d = self.lookups[seq] = PromptLookupDrafter(cfg.lookup_min, cfg.lookup_max)
            drafters = {"lookup": d} if method in ("auto", "lookup") else {}
            if method in ("auto", "ngram"):
                drafters["ngram"] = self.ngrams[seq] = self.ngrams[seq] or NgramCacheDrafter()
            if method in ("auto", "suffix"):
                drafters["suffix"] = self._suffix_drafter(seq)
                drafters["suffix"].beside_lookup = "lookup" in drafters
            if self.drafts is not None and method in ("auto", "draft"):
                drafters["draft"] = self.drafts.drafter(seq, cfg.p_min)
            elif self.xvocab is not None and method in ("auto", "draft"):
                drafters["draft"] = self.xvocab.drafter(seq, cfg.p_min)
            for kind in self.engine.heads:  # the draft heads: a method's own, or every one for auto
                if method in ("auto", kind) and not self.heads.reason(kind):
                    drafters[kind] = self.heads.drafter(seq, kind, cfg.p_min, prompt, common)
            if method == "auto" and hasattr(cfg.constraint, "forced") and self.rows_cheap():
                drafters["grammar"] = GrammarDrafter(cfg.constraint)  # the tokens structured output forces
            if method == "auto":
                drafters = chained(drafters)
        # what a verify of b rows costs is set each step by _price_rows (the whole batch's passes on the calibrated
        # curve); its live T(1) is the slot's share of a step
        policy, label = build_policy(cfg, method if drafters else "none", k, drafters, self.controller_state)
        stats = new_stats(cfg, label, k, level, why)
        stats.rollback = self.ms.rollback_kind
        if "draft" in policy.drafters:
            drafts = self.drafts if self.drafts is not None else self.xvocab
            stats.draft_rollback = drafts.rollback_kind if drafts is not None else "kv"
        if method == "auto" and label != "none" and not set(policy.drafters) - {"lookup", "ngram", "suffix"}:
            why = "batched: auto speculates with prompt lookup, the n-gram cache and the suffix cache"
            stats.reason = "; ".join(x for x in (stats.reason, why) if x)
        stats.prompt_tokens = len(prompt)
        stats.cached_prompt_tokens = common
        stats.prompt_cache = source or ("memory" if common else "")  # a slot's cache: this process's memory
        stats.started = time.perf_counter()
        stats.running = True
        for drafter in policy.drafters.values():
            drafter.begin(prompt)
        self.runs[seq] = _Run(seq, prompt[common:], self.target, prompt, cfg, policy, stats, bias=bias,
                              sink=sink or (lambda ev: None), cancel=cancel)
        self.runs[seq].roll0 = roll0
        if self._keeps_states():
            from localspec.core.prompt_cache import chunk_save_point

            a = chunk_save_point(self.state_chunk, len(prompt))
            cold = self.ms.cold[seq] == common and common % self.state_chunk == 0  # the rest decoded as cold
            self.runs[seq].keep = prompt[:a] if a > common and cold else []
        return seq

    def _rollback_counters(self, seq: int) -> tuple[dict, dict | None]:
        """Slot `seq`'s rollback counters on the target's and the draft model's sequences (take differences)."""
        drafts = self.drafts if self.drafts is not None else self.xvocab
        return self.ms.rollback_counters(seq), (drafts.rollback_counters(seq) if drafts is not None else None)

    def _suffix_drafter(self, seq: int):
        """Slot `seq`'s suffix drafter. The requests finished in the other free slots join the shared corpus first,
        so this one drafts from them."""
        from localspec.drafters.suffix import SuffixDrafter, corpus_for

        corpus = corpus_for(self.target, self.engine.suffix_scope)
        for s, d in enumerate(self.suffixes):
            if s != seq and d is not None and self.runs[s] is None:
                d.finish()
        d = self.suffixes[seq]
        if d is None or d.corpus is not corpus:
            d = self.suffixes[seq] = SuffixDrafter(corpus)
        return d

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
        t0 = time.perf_counter()
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
            per row: the step's flush decodes it, and the slot's controller counts it, as a batch of one does."""
            self.ms.truncate(run.seq, n)
            return per_row * self.ms.pending(run.seq)

        run.guarded(run.verified, rows, cut, share=share)

    def _release(self, run: _Run) -> None:
        self.runs[run.seq] = None
        self.heads.release(run.seq)
        (t0, d0), (t1, d1) = run.roll0, self._rollback_counters(run.seq)
        run.stats.add_rollback(t0, t1, d0, d1)
        run.close()

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
