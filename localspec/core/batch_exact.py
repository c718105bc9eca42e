"""What exactness a request keeps in a batch (core/batch.py), and the KV layout chosen by it: the part of the
BatchEngine that runs the probe of several requests in one pass (core/batch_probe.py), keeps its verdict, chooses the
layout under --kv-layout auto, and answers a request's (k, level, why).

A row's logits can depend on the other rows of its forward pass, so the probe checks every pass shape a bit request
can be in. Alone on the target's own context nothing shares a pass: exactness is the Engine's (verify widths only).
"""
from __future__ import annotations

from localspec.core import batch_probe as BP
from localspec.core import exactness as X
from localspec.core.batch_draft import BatchDraft
from localspec.core.batch_heads import BatchHeads
from localspec.core.batch_probe import ProbeResult
from localspec.core.config import GenConfig
from localspec.core.generation import speculates


class BatchExactness:
    """Mixed into BatchEngine: it provides engine, target, ms, drafts, heads, alone, n_slots, speculative, prefill_chunk,
    _auto, _exact, _ratios, layout_why and _track_cold()."""

    def probe(self, cache: bool = False) -> tuple[bool, str]:
        """(exact, why): whether a sequence's logits stay bit-identical when other sequences' rows share its
        forward passes, and one-token decoding here equals the target's own context. Once per BatchEngine; clears
        the slots' caches and the target's single-sequence cache (call it before the first request). cache: see
        probe_result."""
        return self.probe_result(cache).verdict

    @property
    def layout(self) -> str:
        """Where the slots' KV lives: "unified", "split", "auto" while the probe has not chosen yet, or "single"
        (the target's own context)."""
        if self.alone:
            return "single"
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
        return BP.batch_probe_key(self.target, f"rev={BP.BATCH_REV}", f"slots={self.n_slots}", f"rows={self.bit_rows()}",
                                  f"n_batch={self.ms.n_batch}", f"n_ctx={self.ms.n_ctx}", f"unified={self.ms.unified}",
                                  *rollback)

    def probe_cached(self) -> bool:
        """Whether probe(cache=True) is answered from the cache (or was run already): no probe decodes."""
        return self._exact is not None or BP.cached_batch_probe(self._probe_key()) is not None

    def _cached_probe(self) -> ProbeResult:
        key = self._probe_key()
        res = BP.read_batch_probe(key)
        if res is None:
            res = self._probe()
            res = res if isinstance(res, ProbeResult) else ProbeResult(*res)
            BP.write_batch_probe(key, res, self.target, self.n_slots)
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
        """The probe of several requests in one pass (batch_probe.probe_batch) on this batch's slots."""
        return BP.probe_batch(self.ms, self.target, self.n_slots, self.bit_rows())

    def exactness_for(self, cfg: GenConfig, cancel=None) -> tuple[int, str, str]:
        """(k, level, why) for a request: alone, the Engine's answer (verify widths only; `cancel` stops its probe);
        batched, at lossless where batching is never bit-exact here, and where only some pass shapes are not, at bit
        until the request shares such a pass (step() says)."""
        if self.alone:
            try:
                return self.engine.exactness_for(cfg, cancel)
            except X.ProbeCancelled:  # the caller gave up while the exactness probe ran: plain, then "cancelled"
                return 0, "bit", "bit: the exactness probe was cancelled"
        k, level, why = self.engine.exactness_for(cfg, rows=self.bit_rows())  # the rows its probe decoded
        if level != "bit":
            return k, level, why
        res = self.probe_result()
        if res.exact:
            return k, level, f"{why}; batched with other requests: {res.why}"
        if not res.blanket:
            return k, level, (f"{why}; batched with other requests it stays bit while it shares only passes that are "
                              f"bit-identical here ({res.why})")
        k = cfg.k if speculates(cfg, self.engine.resolve_method(cfg)) else 0
        return k, "lossless", (f"lossless: batched with other requests, and {res.why} here; every token is "
                               "still the target's choice in the pass that emitted it")

