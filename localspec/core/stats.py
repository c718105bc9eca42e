"""Generation statistics: a plain dataclass the decoder fills; core/report.py renders it for every front end."""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass
class Stats:
    method: str = "none"
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # not decoded: reused from the previous turn's KV cache, or restored
    prompt_cache: str = ""  # where they came from: "memory" (this process's cache), "disk" (a stored state), "" none
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    target_passes: int = 0  # target decodes during generation (each emits >= 1 token)
    drafting_steps: int = 0  # target passes that verified at least one drafted token
    plain_s: float = 0.0  # time of the one-token target passes (no draft): what plain decoding costs per token
    drafted_at: list[int] = field(default_factory=list)  # per draft position: times a token was drafted there
    accepted_at: list[int] = field(default_factory=list)  # per draft position: times it was accepted
    prompt_s: float = 0.0  # prompt decode time (both models)
    ttft_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    elapsed_s: float = 0.0
    k_used: Counter = field(default_factory=Counter)  # k chosen per step (adaptive controller)
    method_used: Counter = field(default_factory=Counter)  # drafter used per step
    drafted_by: Counter = field(default_factory=Counter)  # tokens drafted per drafting source (a drafter's name)
    accepted_by: Counter = field(default_factory=Counter)  # of those, accepted by the target
    k_cap: int = 0  # the k in effect: under bit exactness, the largest whose verify batch is bit-exact (exactness.py)
    exactness: str = "bit"  # the level in use: bit | lossless (see GenConfig.exactness)
    exactness_reason: str = ""  # why, in plain words
    reason: str = ""  # why the controller chose what it did, e.g. "auto -> none: draft 0.91x"
    started: float = 0.0  # perf_counter() when the generation began (live figures run from it)
    running: bool = False  # True while tokens are still coming: rates use the clock, not elapsed_s
    emitted_at: deque = field(default_factory=lambda: deque(maxlen=512), repr=False)  # perf_counter per token

    MIN_RATE_TOKENS = 2  # a rate over fewer tokens, or a shorter time, is noise: shown as "—"
    MIN_RATE_S = 0.05
    rpc_workers: list[str] = field(default_factory=list)  # llama.cpp RPC workers holding target layers
    # how rejected tokens are rolled back (llama/model.py): kv | rs | checkpoint | none, and what it cost
    rollback: str = "kv"
    restores: int = 0  # target checkpoint restores (recurrent/hybrid), each followed by a replay
    replayed_tokens: int = 0  # target tokens decoded again after restores
    rs_rollbacks: int = 0  # target rollbacks that selected a recurrent-state plane (no replay)
    checkpoint_bytes: int = 0  # size of the target's saved recurrent state
    rollback_s: float = 0.0  # checkpoint save + restore time (the replay decodes are in verify_s)
    draft_rollback: str = ""  # the draft model's rollback kind ("" when no draft model took part)
    draft_restores: int = 0
    draft_replayed_tokens: int = 0

    def add_rollback(self, before: dict | None, after: dict | None, draft_before: dict | None = None,
                     draft_after: dict | None = None) -> None:
        """Rollback counters of this generation: the models' counters after it minus before."""
        if before and after:
            self.restores += after["restores"] - before["restores"]
            self.replayed_tokens += after["replayed_tokens"] - before["replayed_tokens"]
            self.rs_rollbacks += after["rs_rollbacks"] - before["rs_rollbacks"]
            self.checkpoint_bytes = after["checkpoint_bytes"]
            self.rollback_s += (after["save_s"] + after["restore_s"]) - (before["save_s"] + before["restore_s"])
        if draft_before and draft_after:
            self.draft_restores += draft_after["restores"] - draft_before["restores"]
            self.draft_replayed_tokens += draft_after["replayed_tokens"] - draft_before["replayed_tokens"]

    def record_step(self, n_drafted: int, n_accepted: int, source: str = "") -> None:
        """One target pass that verified n_drafted tokens from `source` (a drafter's name) and accepted n_accepted."""
        self.target_passes += 1
        if n_drafted:
            self.drafting_steps += 1
            if source:
                self.drafted_by[source] += n_drafted
                self.accepted_by[source] += n_accepted
        self.drafted += n_drafted
        self.accepted += n_accepted
        while len(self.drafted_at) < n_drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(n_drafted):
            self.drafted_at[i] += 1
            if i < n_accepted:
                self.accepted_at[i] += 1

    def by_source(self) -> dict[str, tuple[int, int | None, int | None]]:
        """(drafting steps, tokens drafted, tokens accepted) per source that drafted. Steps recorded without their
        source count whole where one source drafted them all; where several did, their split is unknown (None)."""
        steps = {m: n for m, n in self.method_used.items() if m != "none" and n}
        if set(self.drafted_by) == set(steps) or not steps:
            return {m: (n, self.drafted_by[m], self.accepted_by[m]) for m, n in steps.items()}
        if len(steps) == 1 and not self.drafted_by:
            (m, n), = steps.items()
            return {m: (n, self.drafted, self.accepted)}
        return {m: (n, None, None) for m, n in steps.items()}

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def token_emitted(self, now: float | None = None) -> None:
        self.completion_tokens += 1
        self.emitted_at.append(time.perf_counter() if now is None else now)

    @property
    def main_method(self) -> str:
        """The method that actually produced the tokens: the most used drafter, none when it never drafted."""
        used = {m: n for m, n in self.method_used.items() if m != "none"}
        return max(used, key=used.get) if used else "none"

    @property
    def tokens_per_pass(self) -> float:
        """Tokens emitted per target pass during generation, over every step (1.0 = no gain)."""
        return (self.accepted + self.target_passes) / self.target_passes if self.target_passes else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Per drafting step: 1 + accepted drafts / drafting steps (as vLLM reports it); 0 when nothing drafted."""
        return 1.0 + self.accepted / self.drafting_steps if self.drafting_steps else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def generation_s(self) -> float:
        """Seconds since the prompt was processed: up to now while running, to the end once finished."""
        elapsed = (time.perf_counter() - self.started) if (self.running and self.started) else self.elapsed_s
        return max(elapsed - self.prompt_s, 0.0)

    @property
    def tokens_per_second(self) -> float:
        g = self.generation_s
        return self.completion_tokens / g if g > 0 else 0.0

    @property
    def plain_steps(self) -> int:
        return self.target_passes - self.drafting_steps

    def speedup_estimate(self) -> float | None:
        """tokens/s over what plain decoding would give, estimated from this answer's own one-token target passes
        (None when there were too few of them, or nothing was drafted)."""
        rate = self.rate()
        if rate is None or self.plain_steps < 3 or not self.drafting_steps or self.plain_s <= 0:
            return None
        return rate * self.plain_s / self.plain_steps

    def rate(self) -> float | None:
        """tokens/s over the answer so far, or None when the sample is too small to mean anything."""
        if self.completion_tokens < self.MIN_RATE_TOKENS or self.generation_s < self.MIN_RATE_S:
            return None
        return self.tokens_per_second

    def measured_rate(self) -> float | None:
        """tokens/s for machine-readable output: None under MIN_RATE_TOKENS (one token has no rate), otherwise the
        measured figure, however short the answer (a fast machine finishes 12 tokens in under MIN_RATE_S)."""
        if self.completion_tokens < self.MIN_RATE_TOKENS or self.generation_s <= 0:
            return None
        return self.tokens_per_second

    def recent_rate(self, window_s: float = 2.0, now: float | None = None) -> float | None:
        """tokens/s over the last `window_s` seconds of the answer (for the sparkline); None on too small a sample."""
        end = (time.perf_counter() if now is None else now) if self.running else self.started + self.elapsed_s
        emitted = list(self.emitted_at)  # one C-level copy: the engine's thread appends while the TUI reads
        n = sum(1 for t in emitted if end - t <= window_s)
        span = min(window_s, self.generation_s)
        if n < self.MIN_RATE_TOKENS or span < self.MIN_RATE_S:
            return None
        return n / span
