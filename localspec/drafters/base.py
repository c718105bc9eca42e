"""The drafter contract the engine and the controller talk to (after vLLM's v1 proposers and HF's
CandidateGenerator: propose, then feedback on every generator).

Every drafter implements the same methods, with defaults, so neither the engine nor the controller ever tests a
drafter's name or attributes:

- `begin(context)`: a generation starts from the prompt;
- `offer(context, k)`: what it could propose this step without doing the work (None: nothing, e.g. no n-gram
  match), and which estimate judges it (prompt lookup judges each match length apart);
- `propose(context, k, sp, rng)`: up to k tokens, with the distribution they were drawn from;
- `accept(n_drafted, n_accepted)`: the verify result of its own proposal;
- `after_target_decode(tokens, positions)`: called after EVERY target decode (prefill, verify, replay after a
  rollback, and steps where another drafter or none was chosen). Draft heads (MTP, EAGLE-3) read the target's
  hidden states here: they live only until the target's next decode;
- `cost()`: the draft cost per token relative to one target step, until measured (None: unknown);
- `lag(context)`: tokens it must process before it can propose (a draft model's KV trailing the context);
- `close()`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from localspec.sample.sampling import SamplingParams, biased, probs, sample


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    # q[i] is the distribution tokens[i] was drawn from (target vocab size); None: deterministic (one-hot)
    q: np.ndarray | None = None
    # seconds of this proposal spent catching up with the context (a prompt decoded by a draft model): not a
    # per-token draft cost, so the controller does not learn the draft cost from this step
    catch_up_s: float = 0.0

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Offer:
    """What a drafter can propose this step: at most `k` tokens, judged by the estimate named `key`."""

    k: int
    key: str
    prior: float | None = None  # the acceptance to assume for `key` until measured (None: the drafter's prior_alpha)
    # True: the proposal continues an earlier request's text that agrees with the context far back (a repeat), and the
    # adaptive controller may draft it beyond the request's k (core/policy.py, REPEAT_FACTOR)
    repeat: bool = False


class Drafter(ABC):
    name: str = "drafter"
    # True: proposing costs next to nothing and depends on the context alone (prompt lookup), so the adaptive
    # controller asks for a whole proposal every step and judges it against the tokens that follow, drafted or not
    shadowed: bool = False
    prior_alpha: float = 0.5  # acceptance assumed until measured

    def begin(self, context: Sequence[int]) -> None:
        """A generation starts from `context` (the prompt). Cheap to call again with a longer context."""

    def offer(self, context: Sequence[int], k: int) -> Offer | None:
        """Up to how many tokens this drafter can propose now (None: none at all), without proposing them."""
        return Offer(k, self.name) if k > 0 else None

    @abstractmethod
    def propose(self, context: Sequence[int], k: int, sp: SamplingParams, rng: np.random.Generator) -> Proposal:
        """Up to k tokens that may follow `context` (which ends with the target's pending token)."""

    def accept(self, n_drafted: int, n_accepted: int) -> None:
        """The target accepted the first n_accepted of the n_drafted tokens of this drafter's last proposal."""

    def after_target_decode(self, tokens: Sequence[int], positions: Sequence[int]) -> None:
        """The target just decoded `tokens` at `positions` (prefill, verify or replay), whoever drafted."""

    def cost(self) -> float | None:
        """Draft cost per token in target steps, used until measured; None: unknown (the controller's default)."""
        return None

    def lag(self, context: Sequence[int]) -> int:
        """Tokens this drafter must process to catch up with `context` before it can propose."""
        return 0

    def close(self) -> None:
        """Free what the drafter holds."""


def draft_loop(row: np.ndarray, k: int, sp: SamplingParams, rng: np.random.Generator,
               next_row: Callable[[int, int], np.ndarray], confident: Callable[[np.ndarray], bool] | None = None
               ) -> Proposal:
    """The autoregressive loop every model drafter shares (a draft model, a draft head): from a logit row over the
    target's vocabulary, stop when `confident(row)` says the drafter is unsure, else take a token (the argmax at
    temperature 0, else a sample from q shaped like the target's p), then `next_row(token, i)` gives the next row."""
    tokens: list[int] = []
    qs: list[np.ndarray] = []
    for i in range(k):
        t, q = draft_token(row, sp, rng, confident)
        if t is None:
            break
        if q is not None:
            qs.append(q)
        tokens.append(t)
        if i < k - 1:
            row = next_row(t, i)
    return Proposal(tokens, np.stack(qs) if qs else None)


def draft_token(row: np.ndarray, sp: SamplingParams, rng: np.random.Generator,
                confident: Callable[[np.ndarray], bool] | None = None) -> tuple[int | None, np.ndarray | None]:
    """One step of draft_loop: (token, q row or None at temperature 0), or (None, None) where `confident` says the
    drafter is unsure. The request's logit_bias applies first, as on the target's rows."""
    row = biased(row, sp.bias)
    if confident is not None and not confident(row):
        return None, None
    if sp.greedy:
        return int(np.argmax(row)), None
    q = probs(row, sp)
    return sample(q, rng), q


class HeadFileDrafter(Drafter):
    """A draft head in its own GGUF that runs on the target's hidden states (EAGLE-3, DFlash): `head` is the loaded
    file (llama.heads.HeadModel), `ctx` its context, `tap` where it reads the target's hidden states (llama.taps: the
    target's own context, or a batch slot's rows). Subclasses take (target, head, p_min=, cost=, tap=)."""

    head_kind: str = ""
    head = None
    ctx = None
    target = None
    tap = None
    owns_head = True  # False: a slot's copy (for_sequence), the head file is another drafter's
    layer_ids: list[int] = []
    n_embd_tgt = 0
    _cost: float | None = None

    def cost(self) -> float | None:
        return self._cost

    @staticmethod
    def _tap_for(target, tap):
        if tap is not None:
            return tap
        from localspec.llama.taps import TargetTap  # lazily: the registry is imported by front ends without models

        return TargetTap(target)

    def _target_features(self, tokens: Sequence[int], positions: Sequence[int]):
        """(m, pos0, features) of the target's last decode as the tap keeps it (the target's own context: only a long
        prompt's last n_batch chunk), m rows from position pos0, the head's target layers side by side."""
        n = len(tokens)
        feats = self.tap.layer_inp(self.layer_ids, n, self.n_embd_tgt)
        m = len(feats)
        return m, int(positions[n - m]), feats

    def for_sequence(self, tap) -> "HeadFileDrafter":
        """A drafter on the same loaded head with a context of its own, fed from `tap` (a batch slot's rows of each
        batched decode): each slot drafts from its own hidden states, as this one does from the target's."""
        d = type(self)(self.target, self.head, p_min=self.p_min, cost=self._cost, tap=tap)
        d.owns_head = False
        return d

    def keep(self, n: int) -> None:
        """The sequence this drafter follows keeps only its first n tokens; what came after is another text (a new
        request in a batch slot). Forget what was read from there on; the next decode starts a gap or continues."""
        self.ctx.seq_rm(max(int(n), 0))

    def close(self) -> None:
        self.ctx.close()
        if self.owns_head:
            self.head.close()

    @classmethod
    def load(cls, target, path, *, p_min: float = 0.75, n_gpu_layers: int = 0):
        from localspec.llama import heads  # lazily: the registry is imported by front ends that never load a model
        heads.require_head(cls.head_kind)
        head = heads.HeadModel(path, n_gpu_layers=n_gpu_layers)
        try:
            # its cost per drafted token until measured: the head's size over the target's (memory-bound decoding)
            return cls(target, head, p_min=p_min, cost=head.size_bytes() / max(target.size_bytes(), 1))
        except BaseException:
            head.close()
            raise
