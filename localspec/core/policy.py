"""The draft-length policy a generation asks every step for a drafter and k (0 = a plain step): the same every step
(FixedPolicy), or adaptive speculation (AdaptivePolicy): every step, the drafter and k that maximise expected tokens
per second, priced from live estimates on this machine and pair (core/pricing.py). A drafter that loses is not used,
but is probed now and then so it can win back.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

from localspec.core.pricing import DrafterEstimate, VerifyCurve, best_k
from localspec.defaults import HEAD_KINDS
from localspec.drafters.base import Drafter
from localspec.knobs import knobs

PROBE_EVERY = 24  # steps between probes of a drafter that is not being used
PROBE_EVERY_FREE = 8  # ... of one that costs nothing to ask (prompt lookup): a failed probe costs one verify row
CATCH_UP_MAX = 8  # probe a draft model only when its cache is at most this far behind the context
EXPLORE_EVERY = 8  # every so many steps, try one draft token more than the best k, to keep measuring it
RECHECK_EVERY = 4 * PROBE_EVERY  # a drafter that looks hopeless is still probed this often: its figures may be stale
DEFAULT_DRAFT_COST = 0.5  # draft cost per token in target steps, for a drafter that does not say
SWITCH_MARGIN = 1.05  # exactness auto leaves the bit cap only for a k that pays this much more than the cap allows
SWITCH_EVIDENCE = 4.0  # ... judged on an estimate with at least this many (decayed) observations
SWITCH_EVIDENCE_CHEAP = 1.5  # ... where a verify one row wider than the cap allows costs no more
SWITCH_FREE = 0.1  # ... and on none where drafting and verifying that k costs less than this over a one-token step
#                     (prompt lookup on a GPU): a wrong guess there costs next to nothing, waiting costs every match
SHADOW_MAX = 16  # a free drafter's shadow proposals waiting for the tokens that judge them (older ones are dropped)
REPEAT_FACTOR = 2  # an offer that repeats earlier text (Offer.repeat) may be drafted up to this many times k ...
REPEAT_K_MAX = 8  # ... but not beyond this (the verify curve is calibrated up to k = 8: verify_cost.COST_MIN_UPTO)


class Policy(Protocol):
    """What the engine asks of a draft-length policy, fixed or adaptive: each step a drafter (None: a plain step)
    and k, then the step's outcome; `drafters` are every drafter the policy may pick (the engine runs their
    after-decode hooks on every step); `reason` says in words what it chose and why; `switched` is set (to the
    reason) once the policy has left bit exactness for a k above the bit cap (exactness auto)."""

    drafters: dict[str, Drafter]
    switched: str | None

    def choose(self, context: Sequence[int]) -> tuple[Drafter | None, int]: ...

    def observe(self, drafter: Drafter | None, k: int, n_drafted: int, n_accepted: int, t_draft: float | None,
                t_verify: float) -> None: ...

    def reason(self) -> str: ...

    def uncap(self, k: int) -> None:
        """The request left bit exactness (its batch shared a pass that is not bit-exact): k up to `k`."""

    def set_verify_prices(self, ratios: dict[int, float]) -> None:
        """What a verify of b rows costs in plain steps, as its scheduler prices it this step (a batch: the whole
        step's passes); a policy that does not price ignores it."""


class FixedPolicy:
    """Same drafter and k every step (or plain decoding with no drafter)."""

    def __init__(self, drafter: Drafter | None, k: int) -> None:
        self.drafter = drafter
        self.k = k if drafter is not None else 0
        self.drafters = {drafter.name: drafter} if drafter is not None else {}
        self.switched = None

    def choose(self, context: Sequence[int]) -> tuple[Drafter | None, int]:
        return self.drafter, self.k

    def observe(self, drafter, k, n_drafted, n_accepted, t_draft, t_verify) -> None:
        pass

    def reason(self) -> str:
        return ""

    def uncap(self, k: int) -> None:
        if self.drafter is not None:
            self.k = max(self.k, k)

    def set_verify_prices(self, ratios: dict[int, float]) -> None:
        pass


class AdaptivePolicy:
    """Chooses (drafter, k) per step; `state` persists across generations (same engine)."""

    def __init__(self, drafters: dict[str, Drafter], k_max: int, state: dict | None = None,
                 cost_prior: dict | None = None, verify_prior: dict | None = None, bit_cap: int | None = None,
                 repeats: bool = True) -> None:
        """cost_prior: drafter name -> draft cost per token relative to one target step, used until measured
        (default: each drafter's own `cost()`). verify_prior: batch size -> T(b)/T(1) as calibrated on this
        machine, used for batch sizes not yet timed. bit_cap (exactness auto): k stays within it, so verify
        batches are bit-exact, until the cost model says a k above it pays by more than SWITCH_MARGIN; then the
        policy leaves bit exactness for the rest of the answer (`switched` says why) and uses k up to k_max, and
        up to `k_repeat` for an offer that repeats earlier text (Offer.repeat). repeats False: a repeat too stays
        within k_max (exactness bit: k_max is the probe's cap, and a wider verify is not bit-exact)."""
        self.bit_cap = bit_cap if bit_cap is not None and bit_cap < k_max else None
        self.switched: str | None = None
        self.drafters = drafters
        self.cost_prior = {n: d.cost() for n, d in drafters.items() if d.cost() is not None}
        self.cost_prior.update(cost_prior or {})
        self.k_max = max(1, k_max)
        self.k_repeat = repeat_k(self.k_max) if repeats else self.k_max
        st = state if state is not None else {}
        st.setdefault("curve", VerifyCurve())
        st.setdefault("est", {})
        for name in drafters:
            st["est"].setdefault(name, DrafterEstimate(prior_alpha=drafters[name].prior_alpha))
        self.state = st
        self.curve: VerifyCurve = st["curve"]
        if verify_prior:
            self.curve.prior = dict(verify_prior)
        self.est: dict[str, DrafterEstimate] = st["est"]
        cap = self.bit_cap
        narrow, wide = (self.curve.prior.get(cap + 1), self.curve.prior.get(cap + 2)) if cap else (None, None)
        # a verify one row wider costs no more on this machine (kernels that change with the batch width): at any
        # acceptance one more draft token gives more tokens per second, so the cap is left on less evidence
        self.switch_evidence = SWITCH_EVIDENCE_CHEAP if narrow and wide and wide <= narrow else SWITCH_EVIDENCE
        self.step = 0
        self.since_used = {name: 0 for name in drafters}
        self.last_choice = ("none", 0, 0.0)
        self._probing: str | None = None
        self._est_key: dict[str, str] = {}  # drafter name -> the estimate its latest proposal was judged by
        # Shadow proposals of free drafters (prompt lookup): every step such a drafter has a match, its whole
        # proposal (k_max tokens) is noted, drafted or not, and judged against the tokens the target then emits.
        # At temperature 0 that is exactly what a verify would have accepted (at temperature > 0 a draft is accepted
        # exactly when the emitted token equals it), so every position's acceptance is measured for free, also the
        # positions beyond the k actually drafted and the steps it declined: one failed match cannot keep it out of
        # a copied block (docs/design.md, "The controller").
        self._shadows: list[tuple[str, str, int, list[int], int]] = []  # (name, key, position, tokens, judged)
        self._shadowed: set[str] = set()  # drafters whose step this is judged by its shadow
        # Judged by its key, a shadow stands where a drafting run would: not on the step right after a keyed shadow
        # whose first token was right (_covered)
        self._last_keyed: dict[str, tuple[int, list[int]]] = {}  # drafter -> (position, tokens) of its latest keyed shadow
        self._held: dict[str, str] = {}  # drafter -> the key of this step's covered shadow, if the step drafts

    def _estimate(self, key: str, name: str, prior: float | None = None) -> DrafterEstimate:
        """A drafter's offer names the estimate that judges it: prompt lookup keeps one per length of the matched
        context ("lookup@12+"), since a match that reaches 12 tokens back is a copy in progress, accepted far more
        often than a 2-token match in prose, and one pooled figure made auto decline the copies after a few failed
        prose matches. A new key starts from the prior its offer names (else the drafter's), not from the pooled
        figure (which the failed short matches pulled down)."""
        est = self.est.get(key)
        if est is None:
            est = self.est[key] = DrafterEstimate(prior_alpha=self.est[name].prior_alpha if prior is None else prior)
        return est

    def _plain_rate(self) -> float | None:
        t1 = self.curve.t.get(1)
        return 1.0 / t1 if t1 else None

    def _t_token(self, name: str, plain: float) -> float:
        est = self.est[name]
        if est.t_token is not None:
            return est.t_token
        return self.cost_prior.get(name, DEFAULT_DRAFT_COST) / plain

    def choose(self, context: Sequence[int]):
        self.step += 1
        plain = self._plain_rate()
        if plain is None:  # measure one plain step first: every estimate is relative to it
            self.last_choice = ("none", 0, 1.0)
            return None, 0
        self._resolve(context)
        self._shadowed = set()
        self._held = {}
        options = []
        for name, drafter in self.drafters.items():
            offer = drafter.offer(context, self.k_repeat)
            if offer is None or offer.k <= 0:
                continue  # nothing to offer this step (prompt lookup without a match)
            k_cap, key = (offer.k if offer.repeat else min(offer.k, self.k_max)), offer.key
            self._est_key[name] = key
            if self._free(name):
                shadow = list(drafter.propose(context, k_cap, None, None).tokens)
                if shadow:
                    # a step inside the copied stretch a drafting run would have jumped over is judged for the
                    # drafter's pooled figures only (the evidence count that leaves the bit cap, the report), and by
                    # its key only if it drafts after all (observe)
                    covered = self._covered(name, context)
                    self._note_shadow(name, name if covered else key, len(context), shadow)
                    if covered:
                        self._held[name] = key
                    self._shadowed.add(name)
            est = self._estimate(key, name, offer.prior)
            t_tok = self._t_token(name, plain)
            cap = k_cap if self.bit_cap is None else min(k_cap, self.bit_cap)
            k, rate = best_k(est, self.curve, cap, t_tok)
            if cap < k_cap:
                k_full, rate_full = best_k(est, self.curve, k_cap, t_tok)
                bit_best = max(rate, plain)
                if k_full > cap and rate_full > SWITCH_MARGIN * bit_best:
                    # the evidence is the drafter's own (every key's steps): a copy that moved from a short-match
                    # key to a long one had shown lookup paying, but each key alone had too few steps to say so
                    seen = self.est[name].tried
                    free = (k_full * t_tok + self.curve.cost(k_full + 1)) * plain - 1.0 < SWITCH_FREE
                    # a repeat of an earlier request's text (Offer.repeat) is a copy whose acceptance is measured, not
                    # guessed (0.95 at a reach of 12 or more): waiting for evidence only drafted its first steps short
                    if free or offer.repeat or (seen and seen[0] >= self.switch_evidence):
                        self.switched = (f"lossless: k={k_full} pays {rate_full / plain:.2f}x here, the bit cap "
                                         f"k<={self.bit_cap} would give {bit_best / plain:.2f}x")
                        self.bit_cap = None
                        k, rate, cap = k_full, rate_full, k_cap
                    elif name not in self._shadowed:
                        # a bigger k would pay, on figures not yet measured: gather them within the cap (bit-exact),
                        # even where the capped k alone would not pay, or a cap under which nothing pays never yields
                        # the evidence to leave it. A drafter judged by its shadow gets those figures for free, so it
                        # is not drafted at the cap just to measure.
                        k, rate = cap, rate_full
            if k:
                options.append((rate, name, k, cap, t_tok))
        options.sort(reverse=True)
        if options and options[0][0] > plain:
            rate, name, k, k_cap, _ = options[0]
            if self.step % EXPLORE_EVERY == 0 and k < k_cap and name not in self._shadowed:
                k += 1  # keep measuring the next position's acceptance (a shadowed drafter measures it anyway)
            self.last_choice = (name, k, rate / plain)
            return self.drafters[name], k
        # speculation does not pay right now; probe a drafter now and then, if it could win at all
        for rate, name, k, k_cap, t_tok in options:
            if name in self._shadowed:
                continue  # its shadow measures it every step: a probe would only spend a verify row
            every = PROBE_EVERY_FREE if self.cost_prior.get(name) == 0.0 else PROBE_EVERY
            if self.since_used[name] < every:
                continue
            if self.drafters[name].lag(context) > CATCH_UP_MAX:
                continue  # a probe would first decode the whole prompt on the draft model: not worth a guess
            c = self.curve.cost(k + 1)
            hopeless = c is None or (k + 1) / (k * t_tok + c) <= plain
            if hopeless and self.since_used[name] < RECHECK_EVERY * every // PROBE_EVERY:
                continue  # even with every draft accepted it would lose, on the figures so far
            self.since_used[name] = 0
            self._probing = name
            self.last_choice = (name, k, rate / plain)
            return self.drafters[name], k
        self.last_choice = ("none", 0, 1.0)
        return None, 0

    def observe(self, drafter, k, n_drafted, n_accepted, t_draft, t_verify) -> None:
        self.curve.observe(n_drafted + 1, t_verify)
        for name in self.drafters:
            self.since_used[name] += 1
        probing, self._probing = self._probing, None
        if drafter is not None and n_drafted:
            # a probe whose drafts were all accepted is followed by another at once: the regime may be back
            self.since_used[drafter.name] = PROBE_EVERY if (probing == drafter.name and n_accepted == n_drafted) else 0
            if drafter.name in self._shadowed:  # judged by its shadow, which also sees the positions not drafted
                key = self._held.pop(drafter.name, None)
                if key is not None:  # a step it drafted is judged by its key, covered or not
                    i = max(i for i, sh in enumerate(self._shadows) if sh[0] == drafter.name)  # this step's
                    name, _, pos, toks, done = self._shadows.pop(i)
                    self._note_shadow(name, key, pos, toks, done)
                self.est[drafter.name].observe_time(n_drafted, t_draft)
                return
            self._observe(drafter.name, self._est_key.get(drafter.name, drafter.name), n_drafted, n_accepted, t_draft)

    def _observe(self, name: str, key: str, n_drafted: int, n_accepted: int, t_draft: float | None) -> None:
        self.est[name].observe(n_drafted, n_accepted, t_draft)  # pooled: what `estimates()` reports
        if key != name:
            self._estimate(key, name).observe(n_drafted, n_accepted, t_draft)

    def _free(self, name: str) -> bool:
        """Whether a drafter's proposals are judged by shadow (free to make, and a function of the context)."""
        return bool(getattr(self.drafters.get(name), "shadowed", False))

    def _note_shadow(self, name: str, key: str, pos: int, tokens: list[int], done: int = 0) -> None:
        """Keep a shadow proposal for judging (by `key`'s estimate and the drafter's pooled one; by the pooled one
        alone where key is the drafter's name); one judged by its key is where a drafting run would stand."""
        self._shadows.append((name, key, pos, tokens, done))
        del self._shadows[:-SHADOW_MAX]
        if key != name:
            self._last_keyed[name] = (pos, tokens)

    def _covered(self, name: str, context: Sequence[int]) -> bool:
        """Whether the drafter's latest keyed shadow stood on the step before this one and its first token was right:
        a run drafting there (any k >= 1) emitted that token and the next one in the same step, so no drafting run
        stands here. Judged on every step, a copied span of L tokens shows one miss in L + 1 proposals, where a
        drafting run meets its end about once in every L/(k+1) + 1 steps, so short copies look better than drafting
        them is. Skipping the steps every drafting run skips keeps the figure k-free (docs/design.md)."""
        last = self._last_keyed.get(name)
        if last is None:
            return False
        pos, toks = last
        return len(context) - pos == 1 and context[pos] == toks[0]

    def _resolve(self, context: Sequence[int]) -> None:
        """Judge the shadow proposals on the tokens the context now shows, position by position as they come (a
        position is tried when every earlier one was accepted): a copied run counts as soon as its tokens arrive,
        not only when the whole proposal is known."""
        keep = []
        n = len(context)
        for name, key, pos, toks, done in self._shadows:
            if pos + done > n:
                continue  # not this context's (a new answer): drop it
            ests = [self.est[name]] + ([self._estimate(key, name)] if key != name else [])
            while done < len(toks) and pos + done < n:
                hit = context[pos + done] == toks[done]
                for est in ests:
                    est.observe_position(done, hit)
                done += 1
                if not hit:
                    break
            else:
                if done < len(toks):
                    keep.append((name, key, pos, toks, done))
        self._shadows = keep

    def estimates(self) -> dict[str, tuple[int, float]]:
        """Per drafter: (best k, estimated speedup vs plain) from the current estimates."""
        plain = self._plain_rate()
        out = {}
        if not plain:
            return out
        for name, est in self.est.items():
            if name not in self.drafters:
                continue
            k, rate = best_k(est, self.curve, self.k_max, self._t_token(name, plain))
            out[name] = (k, rate / plain)
        return out

    def uncap(self, k: int) -> None:
        self.bit_cap = None
        self.k_max = max(self.k_max, k)
        self.k_repeat = max(self.k_repeat, self.k_max)

    def set_verify_prices(self, ratios: dict[int, float]) -> None:
        self.curve.prior = ratios

    def reason(self) -> str:
        name, k, _ = self.last_choice
        parts = ", ".join(f"{n} {s:.2f}x@k={k_}" for n, (k_, s) in self.estimates().items())
        head = f"auto -> {name}" + (f" k={k}" if k else "")
        return f"{head} ({parts})" if parts else head


def repeat_k(k: int) -> int:
    """The most tokens `auto` drafts in a step that repeats earlier text, where it may use up to k elsewhere: only a
    repeat, accepted whole far more often than a copy inside a request, pays for the wider verify on a steep CPU
    curve (docs/design.md, "Repeats")."""
    return max(k, min(REPEAT_FACTOR * k, REPEAT_K_MAX))


def env_allows_inexact() -> bool:
    """LOCALSPEC_ALLOW_INEXACT=1 (the older switch): `auto` exactness means lossless."""
    return knobs().allow_inexact


def build_policy(cfg, method: str, k: int, drafters: dict[str, Drafter], state: dict | None,
                 costs: Callable[[int], dict | None] | None = None) -> tuple[Policy, str]:
    """(policy, method label) for a request: plain where `method` is none or `k` is 0; the adaptive controller
    where the request asks for it (method auto by default), which starts at the bit cap `k` under exactness auto
    and may leave it for up to cfg.k once it measures that it pays; else one drafter at k (auto without the
    controller: a draft head, else the draft model, else prompt lookup). costs(upto): the target's verify-cost
    curve T(b)/T(1) for b up to `upto` (None: priced by the scheduler each step)."""
    if method == "none" or k == 0:
        return FixedPolicy(None, 0), "none"
    adaptive = cfg.adaptive if cfg.adaptive is not None else method == "auto"
    if adaptive:
        bit_cap = k if (cfg.exactness == "auto" and k < cfg.k and not env_allows_inexact()) else None
        k_max = cfg.k if bit_cap is not None else k
        curve = costs(repeat_k(k_max) + 1) if costs is not None else None
        # under exactness bit, k is the probe's cap for every offer, a repeat's too
        return AdaptivePolicy(drafters, k_max, state, None, curve, bit_cap=bit_cap,
                              repeats=cfg.exactness != "bit"), method
    if method == "auto":
        heads = [d for d in drafters if d in HEAD_KINDS]
        method = heads[0] if heads else ("draft" if "draft" in drafters else "lookup")
    return FixedPolicy(drafters[method], k), method
