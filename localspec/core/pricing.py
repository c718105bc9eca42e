"""What a step of speculation is worth: the expected tokens of a draft of k (Leviathan et al. 2023, section 3.4)
over what it costs to draft and verify on this machine, from decayed estimates of each drafter's acceptance per
position (DrafterEstimate) and the target's verify-cost curve (VerifyCurve):

    E[tokens | k] = 1 + sum_{j=1..k} prod_{i<=j} alpha_i        (alpha_i: acceptance at draft position i)
    cost(k)       = k * t_draft + T_verify(k + 1)
    rate(k)       = E[tokens | k] / cost(k)        vs plain: 1 / T_verify(1)

Estimates are decayed counts, so a change of workload is followed within a few dozen steps.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Sequence

DECAY = 0.9  # weight kept by old observations at each new one (~10-step memory)
PRIOR_WEIGHT = 2.0
PRIOR_VERIFY_SLOPE = 0.35  # T(b)/T(1) = 1 + slope*(b-1) until measured (optimistic: gets tried, then learnt)
OUTLIER = 2.0  # a verify timing above this multiple of the estimate (or of b one-token decodes) is clipped to it
# The calibrated curve is checked against the run's own verify timings: one calibration, taken in a few seconds, read
# 10-20% off what the same machine did minutes later, enough to move auto's choices across plain's line where a
# drafted token barely pays (docs/design.md, "The verify curve")
LIVE_KEEP = 32  # the latest verify steps kept as live judgements of the calibrated curve
LIVE_MIN = 10  # ... at least this many before they may rescale it
LIVE_BAND = 0.2  # the scale moves only when their median leaves the current scale by more than this (timing noise
#                   of a busy machine, 10-30% per step, must not move choices run to run)
LIVE_ONES = 3  # ... judged only once this many one-token steps were timed (what a step's extra cost is relative to)
LIVE_SCALE = (0.5, 2.5)  # the scale stays within these
LIVE_ROW_MIN = 0.05  # a batch whose calibrated extra cost T(b)/T(1) - 1 is below this (a GPU) judges nothing


@dataclass
class DrafterEstimate:
    acc: list[float] = field(default_factory=list)  # decayed accepted counts per position
    tried: list[float] = field(default_factory=list)  # decayed tried counts per position
    t_token: float | None = None  # seconds per drafted token (EMA)
    prior_alpha: float = 0.5

    def alpha(self, i: int) -> float:
        """Acceptance at position i given all earlier drafts were accepted. The prior for position i is the
        estimate at i - 1, so a position never tried yet inherits what was measured before it."""
        prior = self.prior_alpha if i == 0 else self.alpha(i - 1)
        a = self.acc[i] if i < len(self.acc) else 0.0
        d = self.tried[i] if i < len(self.tried) else 0.0
        return (a + prior * PRIOR_WEIGHT) / (d + PRIOR_WEIGHT)

    def alphas(self, n: int) -> list[float]:
        out, prior = [], self.prior_alpha
        for i in range(n):
            a = self.acc[i] if i < len(self.acc) else 0.0
            d = self.tried[i] if i < len(self.tried) else 0.0
            prior = (a + prior * PRIOR_WEIGHT) / (d + PRIOR_WEIGHT)
            out.append(prior)
        return out

    def observe(self, n_drafted: int, n_accepted: int, t_draft: float | None) -> None:
        # position i was tried when drafted and every earlier draft was accepted
        for i in range(min(n_accepted, n_drafted - 1) + 1):
            self.observe_position(i, i < n_accepted)
        self.observe_time(n_drafted, t_draft)

    def observe_position(self, i: int, accepted: bool) -> None:
        """One position's outcome on its own (what observe() records for each position it reaches). Every
        proposal is judged from position 0, and each judgement there ages the figures of every position: a deeper
        position is tried only after the ones before it were accepted, and aged only when tried it kept the figures
        of an answer's first copy through the prose after it, where its position 0 kept failing (docs/design.md,
        "The controller")."""
        while len(self.tried) <= i:
            self.tried.append(0.0)
            self.acc.append(0.0)
        if i == 0:
            self.tried[:] = [t * DECAY for t in self.tried]
            self.acc[:] = [a * DECAY for a in self.acc]
        self.tried[i] += 1.0
        self.acc[i] += 1.0 if accepted else 0.0

    def observe_time(self, n_drafted: int, t_draft: float | None) -> None:
        if t_draft is None:  # this step's draft time included catching up with the prompt: not a per-token cost
            return
        per = t_draft / max(n_drafted, 1)
        self.t_token = per if self.t_token is None else 0.8 * self.t_token + 0.2 * per


@dataclass
class VerifyCurve:
    t: dict[int, float] = field(default_factory=dict)  # batch size -> seconds (EMA)
    prior: dict[int, float] = field(default_factory=dict)  # batch size -> T(b)/T(1) measured once (verify_cost.verify_costs)
    scale: float = 1.0  # what the live timings say the calibrated extra cost T(b)/T(1) - 1 is to be multiplied by
    live: list[float] = field(default_factory=list)  # each verify step's (T(b)/T(1) - 1) / (prior(b) - 1)
    ones: list[float] = field(default_factory=list)  # the latest one-token steps' seconds, what `live` is judged by

    def observe(self, b: int, seconds: float) -> None:
        """Fold in one timing. A busy moment (another process, a first-use allocation) only ever adds time, so a
        sample is clipped to OUTLIER x the current estimate, and a batch's first sample to b one-token decodes."""
        old = self.t.get(b)
        if old is not None:
            seconds = min(seconds, OUTLIER * old)
        elif b > 1 and self.t.get(1):
            seconds = min(seconds, b * self.t[1])
        self._judge(b, seconds)
        self.t[b] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def _judge(self, b: int, seconds: float) -> None:
        """A verify step of b > 1 rows against the calibrated curve: its extra cost over a one-token step (the median
        of the latest ones) relative to the calibrated one. The scale follows their median when it leaves the scale by more than
        LIVE_BAND: a calibration taken at a fast or slow moment is corrected by the steps the run actually paid for,
        while step-to-step noise leaves every choice where it was."""
        if b == 1:
            self.ones.append(seconds)
            del self.ones[:-LIVE_KEEP]
            return
        c = self.prior.get(b)
        if len(self.ones) < LIVE_ONES or c is None or c - 1.0 < LIVE_ROW_MIN:
            return
        t1 = statistics.median(self.ones)  # not the EMA: it stands still through a stretch of drafted steps
        self.live.append((seconds / t1 - 1.0) / (c - 1.0))
        del self.live[:-LIVE_KEEP]
        if len(self.live) >= LIVE_MIN:
            m = statistics.median(self.live)
            if abs(m / self.scale - 1.0) > LIVE_BAND:
                self.scale = min(max(m, LIVE_SCALE[0]), LIVE_SCALE[1])

    def ratio(self, b: int) -> float | None:
        """T(b)/T(1) on the calibrated curve as the live timings scale it (None where not calibrated)."""
        c = self.prior.get(b)
        return None if c is None else 1.0 + (c - 1.0) * self.scale

    def cost(self, b: int) -> float | None:
        """Seconds for a verify batch of b rows. Where the curve was calibrated on this machine, T(1) (live) x the
        calibrated T(b)/T(1), its extra cost scaled by what the run's own verify steps showed (ratio): live timings of
        bigger batches swing by 10-30% on a busy machine, and choices judged on each of them swung run to run on the
        same prompt; with the ratios fixed until the steps' median disagrees, only the acceptances decide."""
        t1 = self.t.get(1)
        if t1 is not None and b in self.prior:
            return t1 * self.ratio(b)
        if b in self.t:
            return self.t[b]
        if t1 is None:
            return None
        # nearest measured smaller batch, extended by the prior slope
        below = [x for x in self.t if x < b]
        base = max(below)
        return self.t[base] + t1 * PRIOR_VERIFY_SLOPE * (b - base)


def expected_tokens(alphas: Sequence[float]) -> float:
    e, run = 1.0, 1.0
    for a in alphas:
        run *= a
        e += run
    return e


def best_k(est: DrafterEstimate, curve: VerifyCurve, k_max: int, t_draft_token: float) -> tuple[int, float]:
    """(k, expected tokens/s) maximising E[tokens|k] / cost(k) over k in 1..k_max."""
    best = (0, 0.0)
    e, run = 1.0, 1.0
    alphas = est.alphas(k_max)
    for k in range(1, k_max + 1):
        run *= alphas[k - 1]
        e += run
        c = curve.cost(k + 1)
        if c is None or c <= 0:
            break
        rate = e / (k * t_draft_token + c)
        if rate > best[1]:
            best = (k, rate)
    return best
