"""One request decoded by the real loop over a simulated target: the replay's engine room.

At temperature 0 the target's answer to a prompt is fixed, so what it chooses after the prompt and the first i tokens
of its answer is the recorded answer's token i, whatever was drafted before. `SimTarget` answers so: each row of a
verify has the recorded token as its argmax. A decode of b rows costs T(b) = T1 x T(b)/T(1) from a verify curve (the
calibration `localspec` measures per machine) on a simulated clock, and a recorded draft model's drafting costs its
draft cost per token there too. `replay()` runs core/generation.py's Generation over it, with the policy that
core/policy.py's build_policy makes for the request's settings: plan, propose, verify and the controller's
observations are the ones `localspec run` makes, only the target and the clock are simulated. So the figures are the
same every run, where timed runs on a 2-core machine spread by 5-10%.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from localspec.core.config import GenConfig
from localspec.core.generation import Generation, new_stats, speculates
from localspec.core.policy import Policy, build_policy
from localspec.defaults import AUTO_MIN_BIT_K, MAX_K
from localspec.drafters.base import Drafter, Proposal

# T(b)/T(1) for b = 1..9 rows, Qwen2.5-Coder-1.5B Q4_K_M with 2 threads (localspec's calibration on each machine)
CURVES = {
    "avx2": {1: 1.0, 2: 1.60, 3: 2.19, 4: 2.67, 5: 3.27, 6: 3.81, 7: 4.46, 8: 6.64, 9: 7.07},
    "avx512": {1: 1.0, 2: 1.5, 3: 1.9, 4: 1.65, 5: 2.2, 6: 2.5, 7: 2.8, 8: 3.0, 9: 3.2},
    "epyc": {1: 1.0, 2: 1.75, 3: 2.25, 4: 2.85, 5: 3.45, 6: 3.95, 7: 4.55, 8: 4.7, 9: 5.05},  # AMD EPYC, AVX-512
    # another AMD EPYC (AVX-512, BF16): the curve its controller priced by, the calibration's extra cost scaled x 1.54 by
    # the verify steps of a busy hour, the steepest any run priced by: a drafted token pays only inside long copies
    "epyc-steep": {1: 1.0, 2: 1.94, 3: 2.81, 4: 3.31, 5: 4.39, 6: 5.25, 7: 6.02, 8: 8.87, 9: 9.98},
    "flat": {b: 1.0 + 0.02 * (b - 1) for b in range(1, 10)},  # a GPU: a batch of 9 costs about one row
}
T1 = 0.065  # seconds per one-token step (only scales the figures)
TICK = 2.0 ** -30  # the simulated clock's resolution: its readings are whole ticks, so a difference of two is exact


def step_cost(curve: dict[int, float], rows: int) -> float:
    """Seconds for a decode of `rows` rows on `curve` (past its end: extended by its last step)."""
    if rows in curve:
        return T1 * curve[rows]
    top = max(curve)
    return T1 * (curve[top] + (curve[top] - curve[top - 1]) * (rows - top))


class SimClock:
    """Simulated seconds: read by calling it (as time.perf_counter), moved on by `advance`. Every reading is a whole
    number of TICKs, so the cost a generation reads as (end - start) is the cost that was advanced, whatever the
    clock read before."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += round(seconds / TICK) * TICK


class SimTarget:
    """The target as recorded: after the prompt and the answer's first i tokens its choice is output[i]. A decode's
    row j (after the pending token and j drafts) has output[i + j] as its argmax, which is all a greedy verify reads;
    rows after a wrong draft are never read. Each decode costs step_cost(curve, rows) on `clock`."""

    def __init__(self, prompt: Sequence[int], output: Sequence[int], curve: dict[int, float], clock: SimClock) -> None:
        self.output, self.curve, self.clock = list(output), curve, clock
        self.n_vocab = max([*prompt, *output]) + 1

    def first_row(self) -> np.ndarray:
        """The prompt's last row (its decode is not timed: replay times the answer after its first token)."""
        return self._rows(0, 1)[0]

    def decode(self, tokens: Sequence[int], at: int) -> np.ndarray:
        """The rows for the pending token and its drafts, where `at` answer tokens are emitted."""
        self.clock.advance(step_cost(self.curve, len(tokens)))
        return self._rows(at, len(tokens))

    def _rows(self, at: int, n: int) -> np.ndarray:
        want = [self.output[min(at + j, len(self.output) - 1)] for j in range(n)]
        rows = np.zeros((n, max(want) + 1), dtype=np.float32)
        rows[np.arange(n), want] = 1.0
        return rows

    def is_eog(self, token: int) -> bool:
        return False  # the answer ends where the recording does: at max_tokens

    def piece(self, token: int) -> bytes:
        return b""


@dataclass
class Setup:
    """A request as the replay starts it, as the front ends resolve it into settings: the method and k asked for,
    the k its exactness allows (`bit_cap`: exactness auto with the probe's cap, k within it bit-exact until auto
    leaves it; None: lossless, k uncapped) and the drafters it has, made afresh for each request by
    `drafters(cfg, trace, clock)`. The policy is core/policy.py's build_policy's for those settings, pricing a verify by
    `prices` (a verify curve; None: the one the replay's steps cost). Called, a Setup makes that policy (trace and clock
    optional)."""

    method: str
    k: int = 0
    drafters: Callable[[GenConfig, dict | None, SimClock | None], dict[str, Drafter]] = \
        field(default=lambda cfg, tr, clock: {})
    bit_cap: int | None = None
    prices: dict[int, float] | None = None

    def config(self, max_tokens: int) -> GenConfig:
        return GenConfig(method=self.method, k=self.k, max_tokens=max_tokens,
                         exactness="lossless" if self.bit_cap is None else "auto")

    def exactness(self, cfg: GenConfig) -> tuple[int, str]:
        """(k, level) as Engine.exactness_for answers them where the probe's cap is `bit_cap`."""
        if not speculates(cfg, self.method):
            return 0, "bit"
        if self.bit_cap is None or self.bit_cap < min(AUTO_MIN_BIT_K, self.k):
            return self.k, "lossless"
        return min(self.k, self.bit_cap), "bit"

    def start(self, trace: dict | None, clock: SimClock | None, curve: dict[int, float] | None,
              max_tokens: int = 1) -> tuple[GenConfig, Policy, object]:
        """The request's settings, policy and stats, as a scheduler's start makes them."""
        cfg = self.config(max_tokens)
        k, level = self.exactness(cfg)
        drafters = self.drafters(cfg, trace, clock) if k else {}
        prices = self.prices if self.prices is not None else curve
        policy, label = build_policy(cfg, self.method if drafters else "none", k, drafters, {},
                                     (lambda upto: dict(prices)) if prices is not None else None)
        return cfg, policy, new_stats(cfg, label, k, level, "")

    def __call__(self, trace: dict | None = None, clock: SimClock | None = None) -> Policy:
        return self.start(trace, clock, None)[1]


def _bare(make: Callable, trace: dict, max_tokens: int) -> tuple[GenConfig, Policy, object]:
    """A policy made by a plain callable (no Setup): decoded at lossless, with the k it asks for each step."""
    policy = make(trace) if getattr(make, "wants_trace", False) else make()
    k = max(1, getattr(policy, "k_max", getattr(policy, "k", 0)) or 0)
    cfg = GenConfig(method="auto", k=min(k, MAX_K), max_tokens=max_tokens, exactness="lossless")
    return cfg, policy, new_stats(cfg, "auto", cfg.k, "lossless", "")


def replay(trace: dict, setup: Setup | Callable[..., Policy], curve: dict[int, float], n: int | None = None) -> dict:
    """Decode `trace` again (its first n answer tokens; None: all) under `setup` on the simulated target: returns
    tokens/s (simulated, the first token's step not timed), steps, drafting steps, drafted and accepted tokens, and
    `switched` (why auto left the bit cap, if it did). `setup` may also be a plain callable that makes a policy."""
    prompt = [int(t) for t in trace["prompt"]]
    out = [int(t) for t in trace["output"]][:n]
    clock = SimClock()
    target = SimTarget(prompt, out, curve, clock)
    if isinstance(setup, Setup):
        cfg, policy, stats = setup.start(trace, clock, curve, len(out))
    else:
        cfg, policy, stats = _bare(setup, trace, len(out))
    gen = Generation(target, prompt, cfg, policy, stats, bias=None, sink=lambda ev: None, clock=clock)
    for d in policy.drafters.values():
        d.begin(prompt)
    gen.start(target.first_row())
    begin = clock()
    while (plan := gen.plan(room=len(out))) is not None:
        rows = gen.propose(*plan)
        gen.step.base = len(gen.context) - 1  # the cache holds every context token but the pending one
        t0 = clock()
        gen.verified(target.decode(rows, len(gen.out)), lambda length: None, t_start=t0)
    gen.close()
    t = clock() - begin
    return {"rate": (len(out) - 1) / t if t else 0.0, "steps": stats.target_passes,
            "spec_steps": stats.drafting_steps, "drafted": stats.drafted, "accepted": stats.accepted,
            "switched": getattr(policy, "switched", None)}


class RecordedDrafter(Drafter):
    """A drafter that proposes what a recorded one proposed at the same position of the same answer (record()):
    `at[i]` followed prompt + output[:i + 1]. Each drafted token costs `draft_cost` target steps on `clock`."""

    def __init__(self, name: str, n_prompt: int, at: Sequence[Sequence[int]], draft_cost: float,
                 clock: SimClock | None = None) -> None:
        self.name, self.n_prompt, self.at, self.draft_cost, self.clock = name, n_prompt, at, draft_cost, clock

    def cost(self) -> float:
        return self.draft_cost

    def propose(self, context, k, sp, rng) -> Proposal:
        i = len(context) - self.n_prompt - 1
        tokens = list(self.at[i][:k]) if 0 <= i < len(self.at) else []
        if self.clock is not None:
            self.clock.advance(len(tokens) * self.draft_cost * T1)
        return Proposal(tokens)
