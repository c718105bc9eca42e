"""One request's decoding, wherever its rows are decoded: alone on the target's own context (core/engine.py) or
beside other requests in a batch (core/batch.py).

A `Generation` holds everything that belongs to the request: its settings, its policy and drafters, the grammar,
the logit bias, the random stream (or the keyed draws of a seed), the stats, the text and its stop strings, cancel.
A scheduler asks it each step what to decode (`plan`, then `propose`: the pending token and the drafts), decodes
those rows in its own way, and hands the logits back (`verified`, or `start` for the prompt's last row); the
generation verifies, emits, and tells the scheduler where to cut its cache. Its events (Piece..., then Finished, or
the request's error) go to `sink`, in order.

Every verify row is what one-token decoding would see at that position: the bias is added to it, the grammar's mask
(the state after the drafts before that row) applied, and a draft is kept only if the target would have chosen it
there (greedy), drawn it (a seed: verify.keyed_verify) or Leviathan's rule accepts it (speculative_sampling).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from localspec.sample.sampling import Draws, bias_vector, probs, sample, token_logprobs
from localspec.core.stats import Stats
from localspec.core.text import TextAssembler
from localspec.sample.verify import NO_TOKEN, greedy_verify, keyed_verify, one_hot, speculative_sampling
from localspec.drafters import Proposal
from localspec.errors import ContextOverflowError, LocalspecError, SettingError, UsageError


@dataclass
class Piece:
    """Streamed text for one emitted token. `text` may be '' while a UTF-8 character is incomplete."""

    text: str
    token: int
    drafted: bool  # True: an accepted draft token; False: the target's own choice
    logprob: float | None = None  # with GenConfig.logprobs: the token's logprob in the row that emitted it
    top: list[tuple[int, float]] | None = None  # ... and the likeliest (token, logprob) there, best first


@dataclass
class Finished:
    text: str
    tokens: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled"
    stats: Stats


@dataclass
class Step:
    """What a generation decodes this step: its pending token and `proposal`'s drafts, each verify row masked by
    `masks` (a grammar) where given. base: the scheduler's cache length before the rows (set by the scheduler)."""

    drafter: Any
    k: int
    proposal: Proposal
    masks: list | None
    t_draft: float | None  # seconds spent drafting (None: it includes a draft model's catch-up on a new prompt)
    base: int = 0


def check_prompt(prompt_tokens: Sequence[int], n_ctx: int, max_tokens: int) -> list[int]:
    """The prompt as ints, or the request's error: empty, or too long for the context."""
    prompt = [int(t) for t in prompt_tokens]
    if not prompt:
        raise UsageError("empty prompt")
    if len(prompt) >= n_ctx:
        raise ContextOverflowError(
            f"prompt is {len(prompt)} tokens but the context holds {n_ctx}; "
            f"use {{ctx_size}} {fit_ctx(len(prompt) + max_tokens)} or a shorter prompt", "ctx_size")
    return prompt


def check_bias(cfg, n_vocab: int) -> np.ndarray | None:
    """The request's logit bias as a vector over the vocabulary (None: none), or its error where it bans every
    token: nothing would be left to say."""
    bias = bias_vector(cfg.logit_bias, n_vocab)
    if bias is not None and np.isneginf(bias).all():
        raise SettingError("{logit_bias} bans every token of the model's vocabulary", "logit_bias")
    return bias


def speculates(cfg, method: str) -> bool:
    """Whether a request drafts at all: a method other than none, and k > 0. Else it decodes plainly, at k 0 (the one
    rule every scheduler and the exactness levels follow)."""
    return method != "none" and cfg.k > 0


def new_stats(cfg, method: str, k_cap: int, level: str, why: str) -> Stats:
    """A request's stats as it starts: the method, the k it may use, the exactness level and why."""
    stats = Stats(method=method, k_cap=k_cap, exactness=level, exactness_reason=why)
    if method != "none" and k_cap < cfg.k:
        stats.reason = f"k capped at {k_cap}: bigger verify batches are not bit-exact with this model/build"
    return stats


def fit_ctx(n: int) -> int:
    """The smallest power-of-two context (from 512) that holds n tokens: what an overflow error suggests."""
    c = 512
    while c < n:
        c *= 2
    return c


def no_token_left(cfg, emitted: int) -> str:
    """How an answer ends where logit_bias and the grammar leave no token to emit: the request's error when its bias
    banned what the grammar allows (a banned token is never emitted); "stop" where the grammar alone allows none."""
    if cfg.logit_bias:
        raise SettingError(f"{{logit_bias}} bans every token the structured output allows at token {emitted + 1} of "
                           "the answer", "logit_bias")
    return "stop"


def grammar_masks(con, proposal: Proposal) -> tuple[Proposal, list]:
    """The grammar's allowed tokens for each verify row: row i after the first i drafts. Drafts after the first
    one the grammar refuses are dropped (that one stays: its masked row rejects it, as speculative sampling
    would); the matcher is rolled back to where it was."""
    masks, n = [], 0
    for t in proposal.tokens:
        m = con.allowed()
        masks.append(m)
        if not m[t] or not con.consume([t]):
            break
        n += 1
    if n == len(proposal.tokens):
        masks.append(con.allowed())
    else:
        keep = n + 1
        proposal = Proposal(proposal.tokens[:keep], None if proposal.q is None else proposal.q[:keep],
                            proposal.catch_up_s)
        masks.append(masks[-1])  # the row after a refused draft is never used
    if n:
        con.rollback(n)
    return proposal, masks


def _constrain(row: np.ndarray, allowed) -> np.ndarray:
    return np.where(allowed[:len(row)], row, -np.inf)


class Generation:
    """One request: see the module's docstring. `prompt` is kept as the context (it grows with the answer; its last
    element is the pending token once the first one is emitted). Not thread-safe: its scheduler's thread only."""

    def __init__(self, target, prompt: list[int], cfg, policy, stats, *, bias: np.ndarray | None, sink: Callable,
                 cancel=None, t0: float | None = None, clock: Callable[[], float] | None = None) -> None:
        """bias: check_bias(cfg, ...), which the scheduler calls before any work (a bias that bans every token is
        the request's error). clock: what its times are read from (default time.perf_counter; a simulated target's
        clock in bench/simulate.py)."""
        self.target = target
        self.cfg = cfg
        self.policy = policy
        self.stats = stats
        self.sink = sink
        self.cancel = cancel
        self.clock = clock or time.perf_counter
        self.t0 = self.clock() if t0 is None else t0
        self.context = prompt
        self.out: list[int] = []
        self.text = TextAssembler(cfg.stop)
        self.finish: str | None = None
        self.error: Exception | None = None
        self.step: Step | None = None  # this step's rows, between propose() and verified()
        # the exactness level in force (bit | lossless): run state the scheduler decides by; stats only report it
        self.level = stats.exactness
        sp = cfg.sampling
        self.bias = bias
        self.banned = {int(t) for t, b in (cfg.logit_bias or {}).items() if b <= -100}
        # the drafters' rows get the bias too, so they propose what the biased target could choose
        self.sp_draft = sp if self.bias is None else dataclasses.replace(sp, bias=self.bias)
        self.rng = np.random.default_rng(sp.seed)
        # a seed: the token at each position is the keyed draw there, whatever drafter and k the policy picks, so the
        # answer is plain decoding's with that seed (sampling.Draws, verify.keyed_verify)
        self.draws = Draws(sp.seed) if sp.seed is not None and not sp.greedy else None
        self._settled = False

    # ------------------------------------------------------------ what the scheduler calls
    def source(self):
        """What the next token (and the drafts after it) are drawn with."""
        return self.draws.at(len(self.context)) if self.draws is not None else self.rng

    def start(self, logits: np.ndarray) -> None:
        """The first token, from the prompt's last row."""
        con, sp = self.cfg.constraint, self.cfg.sampling
        row = self._shape(logits, con.allowed() if con is not None else None)
        if (self.bias is not None or con is not None) and np.max(row) == -np.inf:
            first = NO_TOKEN
        else:
            first = int(np.argmax(row)) if sp.greedy else sample(probs(row, sp), self.source())
        self.stats.ttft_s = self.clock() - self.t0
        self._take([(first, False)], [row])

    def plan(self, room: int, budget: int | None = None) -> tuple[Any, int] | None:
        """This step's (drafter, k), k within what the answer, the cache (`room`: tokens it can take after the
        pending one) and the step (`budget`: rows left) allow; None when the generation has ended (cancelled, or
        out of tokens or room)."""
        if self.finish is not None:
            return None
        if self.cancel is not None and self.cancel.is_set():
            self.end("cancelled")
            return None
        remaining = self.cfg.max_tokens - self.stats.completion_tokens
        if remaining <= 0 or room < 0:
            self.end("length")
            return None
        drafter, k = self.policy.choose(self.context)
        self._left_bit()
        if self.level == "bit":
            # a bit request never verifies more rows than the probe found bit-identical, whatever its policy asks
            # (a repeat offer, a drafter's own length): wider passes write KV rows whose bytes differ from one-token
            # decoding's, and a near-tie later in the answer can then flip
            k = min(k, self.stats.k_cap)
        k = max(0, min(k, remaining - 1, room, k if budget is None else budget))
        return drafter, k

    def propose(self, drafter, k: int, shared_s: float = 0.0) -> list[int]:
        """Draft for this step; returns the rows to decode: the pending token, then the drafts. shared_s: this
        request's share of a draft decode made for several requests at once (batch_draft)."""
        td = self.clock()
        proposal = drafter.propose(self.context, k, self.sp_draft, self.source()) if (drafter is not None and k > 0) \
            else Proposal()
        if len(proposal.tokens) > k:  # the step's rows were planned for k drafts: a longer proposal is cut there
            proposal = Proposal(proposal.tokens[:k], None if proposal.q is None else proposal.q[:k],
                                proposal.catch_up_s)
        if self.banned and any(t in self.banned for t in proposal.tokens):  # the biased rows would reject them
            cut = next(i for i, t in enumerate(proposal.tokens) if t in self.banned)
            proposal = Proposal(proposal.tokens[:cut], None if proposal.q is None else proposal.q[:cut],
                                proposal.catch_up_s)
        masks = None
        if self.cfg.constraint is not None:  # each verify row masked by the grammar state after the drafts before it
            proposal, masks = grammar_masks(self.cfg.constraint, proposal)
        t_draft = self.clock() - td + shared_s
        self.stats.draft_s += t_draft
        self.step = Step(drafter, k, proposal, masks, None if proposal.catch_up_s > 0.0 else t_draft)
        return [self.context[-1], *proposal.tokens]

    def can_extend(self) -> bool:
        """Whether more drafts may be added to this step's proposal after propose() (the batch's padding rows):
        not under a grammar or a bias, whose rows were fixed with the proposal."""
        return self.cfg.constraint is None and self.bias is None

    def verified(self, rows: np.ndarray, truncate: Callable[[int], Any], *, t_start: float | None = None,
                 share: float | None = None) -> None:
        """The step's logits (rows: one per decoded row; rows past the drafts are padding and ignored): verify,
        cut the cache after the accepted tokens (truncate(length)), feed the drafter and the policy, emit.
        The step's cost: `share` seconds (a batch: this request's part of the step) plus what truncate returns (a
        batch: its replay's part of a later decode), or the time since t_start (the replay included)."""
        step, self.step = self.step, None
        st, sp = self.stats, self.cfg.sampling
        drafter, k, proposal = step.drafter, step.k, step.proposal
        gamma = len(proposal.tokens)
        rows = rows[:gamma + 1]
        if self.bias is not None:
            rows = rows + self.bias[:rows.shape[1]]
        if step.masks is not None:
            rows = np.stack([_constrain(r, m) for r, m in zip(rows, step.masks)])
        if sp.greedy:
            top = rows.argmax(axis=1)
            if self.bias is not None or step.masks is not None:  # rows that leave no token
                top[rows.max(axis=1) == -np.inf] = NO_TOKEN
            n_acc, nxt = greedy_verify(proposal.tokens, top)
        elif self.draws is not None:
            n_acc, nxt = keyed_verify(proposal.tokens, lambda i: probs(rows[i], sp), self.draws, len(self.context))
        else:
            p = np.stack([probs(r, sp) for r in rows])
            q = proposal.q if proposal.q is not None else one_hot(proposal.tokens, self.target.n_vocab)
            n_acc, nxt = speculative_sampling(proposal.tokens, q, p, self.rng)
        replay_s = truncate(step.base + 1 + n_acc)
        if drafter is not None and gamma:
            drafter.accept(gamma, n_acc)
        cost = share + (replay_s or 0.0) if share is not None else self.clock() - t_start
        st.verify_s += cost
        if not gamma:
            st.plain_s += cost
        source = drafter.name if (drafter is not None and gamma) else ""
        st.record_step(gamma, n_acc, source)
        st.method_used[source or "none"] += 1
        st.k_used[k if drafter is not None else 0] += 1
        self.policy.observe(drafter, k, gamma, n_acc, step.t_draft, cost)
        self._take([(t, True) for t in proposal.tokens[:n_acc]] + [(nxt, False)], rows)

    def end(self, reason: str) -> None:
        if self.finish is None:
            self.finish = reason

    def guarded(self, fn, *args, **kw) -> None:
        """Run one of this generation's steps (start, verified): the request's own error (its bias leaves no token
        its grammar allows) ends this request only (fail), after the tokens emitted before it."""
        try:
            fn(*args, **kw)
        except LocalspecError as exc:
            self.fail(exc)

    def fail(self, exc: Exception) -> None:
        """The request's error ends it (a batch: the others go on); close() hands it to the sink."""
        self.error = exc
        self.end("error")

    def settle(self) -> None:
        """The stats' final figures (also when the scheduler stops early: an interrupt, an error)."""
        if self._settled:
            return
        self._settled = True
        st = self.stats
        st.elapsed_s = self.clock() - self.t0
        st.running = False
        st.reason = "; ".join(x for x in (st.reason, self.policy.reason()) if x)

    def close(self) -> Finished | None:
        """The end: the text held back (a possible stop string's start) and the Finished, or the error."""
        self.settle()
        if self.error is not None:
            self.sink(self.error)
            return None
        tail = self.text.flush()
        if tail:
            self.sink(Piece(tail, -1, False))
        fin = Finished(self.text.text, self.out, self.finish, self.stats)
        self.sink(fin)
        return fin

    # ------------------------------------------------------------ inside
    def _left_bit(self) -> None:
        """Where the policy has left the bit cap (exactness auto, `switched`), the request is at lossless from the
        next token on, k up to what it asked for: said in its stats, and from where."""
        switched = getattr(self.policy, "switched", None)
        if switched and self.level == "bit":
            st = self.stats
            self.level = st.exactness = "lossless"
            st.k_cap = max(st.k_cap, self.cfg.k)
            st.exactness_reason = f"{switched} (from token {st.completion_tokens + 1})"

    def _shape(self, row: np.ndarray, allowed=None) -> np.ndarray:
        if self.bias is not None:
            row = row + self.bias[:len(row)]
        if allowed is not None:
            row = _constrain(row, allowed)
        return row

    def _take(self, new: list[tuple[int, bool]], rows) -> None:
        cfg, st, con = self.cfg, self.stats, self.cfg.constraint
        for i, (tok, drafted) in enumerate(new):
            if tok != NO_TOKEN and self.target.is_eog(tok):
                self.end("stop")
                return
            if st.completion_tokens >= cfg.max_tokens:
                self.end("length")
                return
            if tok == NO_TOKEN:
                self.end(no_token_left(cfg, st.completion_tokens))
                return
            if con is not None:
                con.consume([tok])
            piece, stopped = self.text.push(self.target.piece(tok))
            self.out.append(tok)
            st.token_emitted()
            ev = Piece(piece, tok, drafted)
            if cfg.logprobs is not None:
                ev.logprob, ev.top = token_logprobs(rows[i], tok, cfg.logprobs)
            self.context.append(tok)
            self.sink(ev)
            if stopped:
                self.end("stop")
                return
