"""How a batched step's rows become forward passes, and what a drafted row costs in them: the part of the
BatchEngine (core/batch.py) that reads the probe's pass shapes and the target's verify curve.

llama.cpp runs a batch over separate KV streams as passes of consecutive sequences with equal rows each
(multiseq.split_equal); in one unified cache a step is one pass. So a step's shape decides both its cost and, where
the probe found some shapes not bit-identical, a `bit` request's exactness (docs/design.md, "Batching").
"""
from __future__ import annotations

from localspec.core.batch_cost import batch_ratios, pass_cost
from localspec.drafters import Proposal

MAX_ROWS = 65  # a verify's rows at most (k <= 64)
ROW_CHEAP = 1.25  # T(2)/T(1) at most this: a verify row costs next to nothing (rows_cheap)


class PassShapes:
    """Mixed into BatchEngine: it provides ms, runs, engine, target, pad, probe_result(), bit_rows(), _live(),
    _curve and _ratios."""

    def shape_exact(self, n_seqs: int, rows: int, beside_prompt: bool = False) -> bool:
        """Whether a forward pass of n_seqs requests x rows each (beside_prompt: one of them a prompt chunk) keeps a
        bit request's rows bit-identical, by the probe."""
        res = self.probe_result()
        if n_seqs < 2:
            return rows <= self.bit_rows()  # alone: the engine's own k cap
        if res.exact:
            return rows <= self.bit_rows() or beside_prompt
        if res.blanket:
            return False
        if beside_prompt:
            return rows == 1 and res.beside_prompt.get(n_seqs, False) and res.shapes.get((n_seqs, 1), False)
        return res.shapes.get((n_seqs, rows), False)

    def _apart(self, parts: list, owners: list) -> list[tuple[list, list]]:
        """The step's decodes: one, or more where a prompt chunk beside other requests' rows would cost a `bit`
        request its exactness (the probe found such a pass not bit-identical, as on CPUs where ggml repacks Q4_K
        weights). Then the generating rows decode first and the prompt chunks
        after, on their own, and where two prompts joining in the same step would share a pass, each on its own.
        Over separate KV streams that costs about no extra pass: llama.cpp ran a prompt's rows past the fewest any
        sequence of its pass had as a pass of their own anyway (split_equal), so only the shared pass is split."""
        bit = {run.seq for run in owners if run.level == "bit"}
        if self.ms.unified or len(parts) < 2 or not bit or not self._costs_bit(parts, owners, bit):
            return [(parts, owners)]
        gen = [j for j, run in enumerate(owners) if run.step is not None]
        rest = [j for j in range(len(owners)) if j not in gen]
        groups = [gen] if gen else []
        if len(rest) > 1 and self._costs_bit([parts[j] for j in rest], [owners[j] for j in rest], bit):
            groups += [[j] for j in rest]
        else:
            groups.append(rest)
        return [([parts[j] for j in g], [owners[j] for j in g]) for g in groups]

    def _costs_bit(self, parts: list, owners: list, bit: set) -> bool:
        """Whether a pass of this decode holds a prompt chunk beside other rows, with a `bit` request among them,
        in a shape the probe did not find bit-identical."""
        prompt_seqs = {parts[j][0] for j, run in enumerate(owners) if run.step is None}
        for ub in self.ms.passes([(p[0], len(p[1])) for p in parts]):
            seqs = {seq for seq, _, _ in ub}
            if len(ub) < 2 or not (seqs & prompt_seqs) or not (seqs & bit):
                continue
            if not self.shape_exact(len(ub), ub[0][2], beside_prompt=True):
                return True
        return False

    def _pad(self, parts: list, owners: list) -> None:
        """One forward pass for the step where it can be: llama.cpp runs a batch over separate KV streams as passes
        of consecutive sequences with EQUAL rows each (multiseq.split_equal), so generating slots with different
        draft lengths (rows [1, 4, 1, 3]) cost several passes, each reading the weights again. Pad every generating
        slot to the step's most rows with filler rows (their logits are not used; they are rolled back with the
        rejected drafts), where the cache has room and, for a request that asked for bit and is still at it, the
        padded pass shape is bit-identical here. Not while a prompt chunk is in the step (its rows split the passes
        anyway)."""
        if self.pad is False or len(parts) < 2 or self.ms.unified or any(run.step is None for run in owners):
            return
        r = max(len(p[1]) for p in parts)
        if all(len(p[1]) == r for p in parts) or r * len(parts) > self.ms.n_batch:
            return
        for run in owners:
            if len(self.ms.tokens[run.seq]) + r > self.n_ctx:
                return
        if self.pad is None and not self._padding_pays([(p[0], len(p[1])) for p in parts], r):
            return
        # only a request that asked for bit is kept from a padded shape the probe found not bit-identical: one
        # decoding plainly under auto or lossless reports bit but was never promised it, and padding pays for all
        bit = {run.seq for run in owners if run.level == "bit" and run.cfg.exactness == "bit"}
        for ub in self.ms.passes([(p[0], r) for p in parts]):
            if bit & {seq for seq, _, _ in ub} and not self.shape_exact(len(ub), r):
                return
        for j, ((seq, toks, _), run) in enumerate(zip(parts, owners)):
            if len(toks) < r:
                toks = self._more_drafts(run, toks, r)
                parts[j] = (seq, [*toks, *[toks[-1]] * (r - len(toks))], range(r))

    def _price_rows(self, n: int) -> None:
        """What a slot's drafted rows cost this step, for the slots' controllers (Must-have: k per request from the
        cost of the whole batch). Each slot is timed by its share of the step (a plain step: the step / n), and a
        verify of b rows is priced at 1 + (C(b) - C(1)) / (C(1) / n), where C is the step's cost with this slot at
        b rows and the other n - 1 at one, in passes as llama.cpp runs them (multiseq.split_equal) on the target's
        calibrated curve: over separate KV streams the b - 1 drafted rows run as a pass of their own (or the step
        is padded, where that is cheaper), in one unified cache they join the pass. Alone (n = 1) that is the
        single-sequence curve itself. On a compute-bound CPU other requests' rows fill the machine and a drafted
        row costs more than alone; on a GPU about nothing."""
        curve = self._calibrated()
        if not curve:
            return
        one_pass = self.ms.unified and not self.ms.recurrent  # a recurrent target's steps split per sequence
        key = (n, one_pass)
        ratios = self._ratios.get(key)
        if ratios is None:
            ratios = self._ratios[key] = batch_ratios(curve, n, one_pass, self.pad is not False, MAX_ROWS)
        for run in self._live():
            run.policy.set_verify_prices(ratios)

    def _calibrated(self) -> dict[int, float]:
        if self._curve is None:
            self._curve = self.engine.verify_costs(2) or {}
        return self._curve

    def rows_cheap(self) -> bool:
        """Whether a second verify row costs at most ROW_CHEAP steps beside the first, on the target's calibrated curve
        (a GPU). Certain drafts (the grammar's forced tokens) are drafted in a slot only there: on a compute-bound CPU
        the other slots' rows already fill the machine, so a drafted row costs about what the token it saves does,
        and drafting even certain tokens was measured a loss (docs/benchmarks.md, "Grammar-constrained
        speculation")."""
        curve = self._calibrated()
        return bool(curve) and curve.get(2, ROW_CHEAP + 1.0) <= ROW_CHEAP

    def _padding_pays(self, rows: list[tuple[int, int]], r: int) -> bool:
        """Whether one padded pass (every slot at r rows) costs less than the passes llama.cpp splits the step into,
        on the target's calibrated verify curve (a pass of b rows costs T(b)/T(1) steps, extended along its last
        slope). On a compute-bound CPU every row costs about half a step, and the filler rows cost more than the
        passes they save; on a GPU rows are nearly free and a pass is what costs. Without a calibration: only with
        GPU layers."""
        if not self._calibrated():
            return getattr(self.target, "n_gpu_layers", 0) > 0
        split = sum(pass_cost(self._curve, len(ub) * ub[0][2]) for ub in self.ms.passes(rows))
        return pass_cost(self._curve, r * len(rows)) < split

    def _more_drafts(self, run, toks: list[int], r: int) -> list[int]:
        """A padded greedy prompt-lookup slot drafts into its padding where the lookup has more (rows the step
        pays for anyway); the proposal grows, its rows verified as any. Returns the slot's rows (pending + drafts)."""
        step = run.step
        drafter, proposal = step.drafter, step.proposal
        # a shadowed drafter (prompt lookup) proposes from the context alone, at next to no cost: asked again
        if drafter is None or not drafter.shadowed or not run.cfg.sampling.greedy or not run.can_extend():
            return toks
        room = run.cfg.max_tokens - run.stats.completion_tokens - 1
        more = drafter.propose(run.context, min(r - 1, room), run.cfg.sampling, run.source())
        if len(more.tokens) <= len(proposal.tokens) or list(more.tokens[:len(proposal.tokens)]) != \
                list(proposal.tokens):
            return toks
        step.proposal = Proposal(list(more.tokens), None)
        return [toks[0], *more.tokens]

    def _note_shapes(self, parts: list, owners: list) -> None:
        """Where the probe found some pass shapes not bit-exact: a request at bit that shares such a pass now
        runs at lossless, and its stats say from which token and why. A request that runs alone stays bit."""
        res = self.probe_result()
        if res.exact or res.blanket:
            return
        by_seq = {run.seq: run for run in owners}
        for ub in self.ms.passes([(p[0], len(p[1])) for p in parts]):
            if len(ub) < 2:
                continue
            runs = [by_seq[seq] for seq, _, _ in ub]
            r = ub[0][2]
            prompt = any(run.step is None for run in runs)
            if self.shape_exact(len(ub), r, prompt):
                continue
            what = "beside another request's prompt chunk" if prompt else f"of {len(ub)} requests x {r} rows"
            for run in runs:
                st = run.stats
                if run.level != "bit":
                    continue
                run.level = st.exactness = "lossless"
                st.exactness_reason = (f"lossless: batched, and from token {st.completion_tokens + 1} it shared a "
                                       f"pass {what}, and {res.why} here; every token is still the target's "
                                       "choice in the pass that emitted it")
                self._uncap(run)

    def _uncap(self, run) -> None:
        """A request no longer at bit has no reason to keep the bit k cap: k up to what it asked for."""
        pol, k = run.policy, run.cfg.k
        pol.uncap(k)
        if run.stats.k_cap < k and pol.drafters:
            run.stats.k_cap = k
