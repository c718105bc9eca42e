"""core/policy.py and core/pricing.py: the adaptive controller on synthetic acceptance streams and timings (no model)."""

import pytest
import numpy as np

from localspec.core.policy import AdaptivePolicy
from localspec.core.pricing import DrafterEstimate, VerifyCurve, best_k, expected_tokens
from localspec.drafters.base import Drafter, Offer, Proposal

T1 = 0.030


class FakeDrafter(Drafter):
    """The drafter contract with nothing behind it: the controller sees only offers and outcomes."""

    def __init__(self, name="draft"):
        self.name = name

    def propose(self, context, k, sp, rng):
        raise AssertionError("the controller never proposes")


class FakeLookup(FakeDrafter):
    """Offers what `match` finds, judged per match length, as prompt lookup does."""

    def __init__(self):
        super().__init__("lookup")

    def offer(self, context, k):
        tokens, n = self.match(context, k)
        return Offer(len(tokens), f"lookup@{n}") if tokens else None


def simulate(policy, alpha_at, c, curve, steps, rng, name="draft"):
    """Run the choose/observe loop; alpha_at(step) gives the acceptance probability; returns k per step."""
    ks = []
    for step in range(steps):
        drafter, k = policy.choose([1, 2, 3])
        ks.append(k if drafter is not None else 0)
        if drafter is None or k == 0:
            policy.observe(None, 0, 0, 0, 0.0, curve(1))
            continue
        a = alpha_at(step)
        n = 0
        while n < k and rng.random() < a:
            n += 1
        policy.observe(drafter, k, k, n, k * c * T1, curve(k + 1))
    return ks


flat = lambda b: T1 * (1 + 0.02 * (b - 1))  # noqa: E731  GPU-like: verifying 9 costs about one
cpu = lambda b: T1 * (1 + 0.55 * (b - 1))  # noqa: E731  2-core CPU: each extra row costs half a token


def test_high_acceptance_cheap_draft_uses_large_k():
    p = AdaptivePolicy({"draft": FakeDrafter()}, k_max=8, cost_prior={"draft": 0.05})
    ks = simulate(p, lambda s: 0.95, 0.05, flat, 150, np.random.default_rng(0))
    assert np.mean(ks[50:]) >= 6


def test_low_acceptance_or_expensive_draft_uses_plain():
    p = AdaptivePolicy({"draft": FakeDrafter()}, k_max=8, cost_prior={"draft": 0.05})
    ks = simulate(p, lambda s: 0.1, 0.05, cpu, 200, np.random.default_rng(1))
    assert np.mean([k == 0 for k in ks[50:]]) > 0.9
    p = AdaptivePolicy({"draft": FakeDrafter()}, k_max=8, cost_prior={"draft": 0.5})
    ks = simulate(p, lambda s: 0.9, 0.9, cpu, 200, np.random.default_rng(2))
    assert np.mean([k == 0 for k in ks[50:]]) > 0.95  # cannot win even at alpha = 1: never probed again


def test_regime_change_is_followed():
    p = AdaptivePolicy({"draft": FakeDrafter()}, k_max=8, cost_prior={"draft": 0.05})
    alpha = lambda s: 0.95 if s < 200 or s >= 400 else 0.05  # noqa: E731
    ks = simulate(p, alpha, 0.05, cpu, 600, np.random.default_rng(3))
    assert np.mean(ks[150:200]) >= 2
    # within 30 steps of the drop, speculation stops (probes aside)
    assert np.mean([k == 0 for k in ks[230:400]]) > 0.85
    # after acceptance comes back, a probe finds it again within a bounded number of steps
    assert np.mean(ks[450:600]) >= 2


def test_lookup_only_considered_with_a_match():
    class Lookup(FakeLookup):
        def __init__(self):
            super().__init__()
            self.proposal = []

        def match(self, context, k):
            return self.proposal[:k], 2

    lk = Lookup()
    p = AdaptivePolicy({"lookup": lk}, k_max=4, cost_prior={"lookup": 0.0})
    p.observe(None, 0, 0, 0, 0.0, T1)  # one plain step measured
    assert p.choose([1]) == (None, 0)  # no match: plain
    lk.proposal = [5, 6, 7]
    d, k = p.choose([1])
    assert d is lk and 1 <= k <= 3  # never more than the match offers


def test_expected_tokens_and_best_k_arithmetic():
    assert expected_tokens([]) == 1.0
    assert abs(expected_tokens([0.5, 0.5]) - 1.75) < 1e-12
    est = DrafterEstimate(prior_alpha=0.8)
    assert abs(est.alpha(0) - 0.8) < 1e-12 and abs(est.alpha(3) - 0.8) < 1e-12  # untried positions inherit
    est.observe(4, 4, 0.01)
    assert est.alpha(0) > 0.8 and est.t_token == 0.0025
    curve = VerifyCurve({1: 1.0, 2: 1.0, 3: 1.0})
    k, rate = best_k(DrafterEstimate(prior_alpha=0.99), curve, 2, 0.0)
    assert k == 2 and abs(rate - expected_tokens([0.99, 0.99])) < 1e-9


def test_one_outlier_measurement_does_not_switch_speculation_off_for_good():
    """One verify timed on a busy moment at several times its cost must not make every k look hopeless for good:
    the drafter is probed again and the curve re-measured, so auto goes back to drafting (lossless, k<=8) instead
    of staying plain for every later prompt."""

    class Lookup(FakeLookup):
        def match(self, context, k):
            return [7] * k, 2

    lk = Lookup()
    p = AdaptivePolicy({"lookup": lk}, k_max=8, cost_prior={"lookup": 0.0})
    p.observe(None, 0, 0, 0, 0.0, cpu(1))
    d, k = p.choose([1])
    assert d is lk
    p.observe(lk, 1, 1, 0, 0.0, 6 * cpu(2))  # rejected, and timed while something else ran
    ks = simulate(p, lambda s: 0.9, 0.0, cpu, 400, np.random.default_rng(4), name="lookup")
    assert np.mean([k > 0 for k in ks[200:]]) > 0.9  # re-checked within RECHECK_EVERY steps, then used


def test_a_calibrated_curve_lets_the_controller_pick_a_cheaper_bigger_batch():
    """On a 2-core AVX-512 CPU a verify batch of 4 rows costs less than one of 3 (repacked GEMM from 4 rows): a cost
    guessed from T(3) and a slope keeps k <= 2 there, the calibrated curve lets the controller take k=3."""
    measured = {1: 1.0, 2: 1.5, 3: 1.9, 4: 1.65, 5: 2.2, 6: 2.5, 7: 2.8, 8: 3.0, 9: 3.4}
    curve = lambda b: T1 * measured[b]  # noqa: E731
    est = DrafterEstimate(prior_alpha=0.7)
    guessed = VerifyCurve({1: T1, 2: curve(2), 3: curve(3)})
    assert best_k(est, guessed, 8, 0.0)[0] <= 2
    calibrated = VerifyCurve({1: T1, 2: curve(2), 3: curve(3)}, prior=measured)
    assert calibrated.cost(4) == T1 * 1.65 and calibrated.cost(2) == curve(2)  # T(1) x the calibrated ratio
    assert best_k(est, calibrated, 8, 0.0)[0] == 3
    p = AdaptivePolicy({"draft": FakeDrafter()}, k_max=8, cost_prior={"draft": 0.0}, verify_prior=measured)
    assert p.curve.prior == measured


def test_lookup_is_judged_per_match_length():
    """Each lookup match length has its own acceptance estimate: pooled into one figure, failed 2-token matches in
    the prose would make the controller decline the 4-token matches of the code being copied."""

    class Lookup(FakeLookup):
        def __init__(self):
            super().__init__()
            self.n = 2

        def match(self, context, k):
            return [7] * k, self.n

    lk = Lookup()
    measured = {1: 1.0, 2: 1.5, 3: 1.9, 4: 1.65, 5: 2.2, 6: 2.5, 7: 2.8, 8: 3.0, 9: 3.4}
    p = AdaptivePolicy({"lookup": lk}, k_max=8, cost_prior={"lookup": 0.0}, verify_prior=measured)
    rng = np.random.default_rng(5)
    took = {2: [], 4: []}
    p.observe(None, 0, 0, 0, 0.0, T1)
    for step in range(600):
        lk.n = 4 if (step // 3) % 2 else 2  # prose and copied code, a few steps each
        alpha = 0.9 if lk.n == 4 else 0.1
        drafter, k = p.choose([1, 2, 3])
        took[lk.n].append(drafter is not None and k > 0)
        if drafter is None or k == 0:
            p.observe(None, 0, 0, 0, 0.0, T1)
            continue
        n = 0
        while n < k and rng.random() < alpha:
            n += 1
        p.observe(drafter, k, k, n, 0.0, T1 * measured[k + 1])
    assert np.mean(took[4][100:]) > 0.9  # the copies are drafted
    assert np.mean(took[2][100:]) < 0.2  # the prose matches mostly not


def test_exactness_auto_leaves_the_bit_cap_only_when_a_bigger_k_pays():
    """Exactness auto keeps bit-exactness only where it is free: with a verify curve where bigger batches are cheap
    and drafts accepted, the policy leaves the bit cap k<=2 and says why; where bigger batches cost what they gain,
    or acceptance is low, it keeps it."""

    class Lookup(FakeLookup):
        def match(self, context, k):
            return [7] * k, 4

    def run(curve, alpha, seed):
        lk = Lookup()
        p = AdaptivePolicy({"lookup": lk}, k_max=8, cost_prior={"lookup": 0.0},
                           verify_prior={b: curve(b) / T1 for b in range(1, 10)}, bit_cap=2)
        ks = simulate(p, lambda s: alpha, 0.0, curve, 200, np.random.default_rng(seed), name="lookup")
        return p, ks

    p, ks = run(flat, 0.95, 1)  # GPU-like curve, copied text: k=8 pays far more than k<=2
    assert p.switched and p.switched.startswith("lossless: k=") and "bit cap k<=2" in p.switched
    first = next(i for i, k in enumerate(ks) if k > 2)
    assert all(k <= 2 for k in ks[:first]) and max(ks) > 2
    steep = lambda b: T1 * b  # noqa: E731  every row costs a full step: no k above the cap can pay more
    p, ks = run(steep, 0.95, 2)
    assert p.switched is None and max(ks) <= 2
    cheap = lambda b: T1 * (1 + 0.15 * (b - 1))  # noqa: E731  a wrong guess of k=4 costs 0.6 of a step
    p, ks = run(cheap, 0.3, 3)  # prose: low acceptance, bigger k does not pay enough
    assert p.switched is None and max(ks) <= 2


def test_exactness_auto_leaves_the_bit_cap_at_the_first_match_where_a_wrong_guess_costs_next_to_nothing():
    """Where drafting and verifying k tokens costs next to nothing over a one-token step (prompt lookup on a GPU),
    the bit cap is left at the first match the prior says pays, with no observation yet: waiting for evidence cost
    every match its drafts. Where a wrong guess costs more, the cap holds until acceptances are observed."""

    class Lookup(FakeLookup):
        def match(self, context, k):
            return [7] * k, 4

    def first_steps(curve, cost):
        p = AdaptivePolicy({"lookup": Lookup()}, k_max=4, cost_prior={"lookup": cost},
                           verify_prior={b: curve(b) / T1 for b in range(1, 10)}, bit_cap=2)
        return p, simulate(p, lambda s: 0.9, cost, curve, 3, np.random.default_rng(0), name="lookup")

    p, ks = first_steps(flat, 0.0)
    assert ks[1] > 2 and p.switched and "bit cap k<=2" in p.switched  # the first step measures plain decoding
    p, ks = first_steps(flat, 0.1)  # a drafted token that costs a tenth of a step: four of them are no free guess
    assert max(ks) <= 2 and p.switched is None
    p, ks = first_steps(lambda b: T1 * (1 + 0.15 * (b - 1)), 0.0)
    assert max(ks) <= 2 and p.switched is None


def test_exactness_auto_leaves_the_bit_cap_at_once_for_a_repeat_of_an_earlier_request():
    """A repeat of an earlier request's text (Offer.repeat: the suffix cache continues a match that reaches 12 or more
    tokens back into it, the same request sent again) leaves the bit cap at its first step where the bigger k pays:
    such a copy was accepted 0.95 of the time on the recorded answers, and the evidence wait drafted the first dozen
    tokens of a repeated answer at k <= 2. The same offer not marked a repeat still waits for acceptances."""

    class Copy(FakeLookup):
        repeat = True

        def offer(self, context, k):
            return Offer(k, "suffix@12+", 0.9, repeat=self.repeat)

        def match(self, context, k):
            return [7] * k, 12

    def first_steps(repeat):
        d = Copy()
        d.repeat = repeat
        curve = lambda b: T1 * (1 + 0.15 * (b - 1))  # noqa: E731  a wrong guess costs 0.15 of a step a row
        p = AdaptivePolicy({"lookup": d}, k_max=4, cost_prior={"lookup": 0.0},
                           verify_prior={b: curve(b) / T1 for b in range(1, 10)}, bit_cap=2)
        return p, simulate(p, lambda s: 0.95, 0.0, curve, 3, np.random.default_rng(0), name="lookup")

    p, ks = first_steps(True)
    assert ks[1] > 2 and p.switched and "bit cap k<=2" in p.switched  # the first step measures plain decoding
    p, ks = first_steps(False)
    assert max(ks) <= 2 and p.switched is None


def test_decisions_do_not_swing_with_timing_noise_when_the_curve_is_calibrated():
    """The same prompt gets the same decisions run after run: live verify timings swing by 10-30% on a busy 2-core
    machine, so k is not judged on them. With a calibrated curve T(b)/T(1), a step's cost is T(1) x that ratio: the
    same acceptances give the same choices whatever the timings, and only the acceptances decide."""
    measured = {b: 1 + 0.55 * (b - 1) for b in range(1, 10)}
    accept = np.random.default_rng(7).random((300, 8))  # the same acceptance stream in every run

    class Lookup(FakeLookup):
        def match(self, context, k):
            return [7] * k, 4

    def run(noise_seed):
        noise = np.random.default_rng(noise_seed)
        p = AdaptivePolicy({"lookup": Lookup()}, k_max=8, cost_prior={"lookup": 0.0}, verify_prior=measured,
                           bit_cap=2)
        choices = []
        for step in range(300):
            drafter, k = p.choose([1, 2, 3])
            choices.append(k if drafter is not None else 0)
            jitter = 1.0 + 0.3 * noise.random()  # a busy machine only ever adds time
            if drafter is None or k == 0:
                p.observe(None, 0, 0, 0, 0.0, T1 * jitter)
                continue
            n = 0
            while n < k and accept[step, n] < 0.85:
                n += 1
            p.observe(drafter, k, k, n, 0.0, T1 * measured[k + 1] * jitter)
        return choices, p.switched

    runs = [run(seed) for seed in range(6)]
    assert max(max(c) for c, _ in runs) > 0  # it speculates at all
    assert all(r == runs[0] for r in runs[1:])


class ShadowLookup(Drafter):
    """A free drafter judged by shadow over a known answer: from every position it proposes `right` for the next
    tokens where they are in `copied`, else a token the answer never has."""

    name = "lookup"
    shadowed = True

    def __init__(self, answer, copied, prior=None):
        self.answer, self.copied, self.prior = answer, copied, prior

    def offer(self, context, k):
        return Offer(k, "lookup@x", self.prior)

    def propose(self, context, k, sp, rng):
        n = len(context)
        return Proposal([self.answer[n + j] if (n + j) in self.copied else -1
                         for j in range(k) if n + j < len(self.answer)])


def test_a_shadow_on_a_step_every_drafting_run_skips_is_not_judged_by_its_key():
    """Right after a shadow whose first token was right, a run drafting there (any k) emits that token and the next
    in one step, so it never stands on this step: the shadow there is not judged by its key, or a copied span's L
    hits would count against its one miss, where a drafting run meets the miss once in every few steps. Its figures
    still count for the drafter's pooled estimate (the evidence to leave the bit cap), and by its key where the step
    drafts after all."""
    answer = list(range(100, 140))
    lk = ShadowLookup(answer, copied=set(range(10, 14)))  # right from position 10 to 13
    p = AdaptivePolicy({"lookup": lk}, k_max=4, cost_prior={"lookup": 0.0},
                       verify_prior={b: 1.0 + 0.75 * (b - 1) for b in range(1, 10)})  # nothing pays: plain steps
    p.observe(None, 0, 0, 0, 0.0, T1)
    for n in range(9, 16):
        drafter, k = p.choose(answer[:n])
        assert drafter is None
        p.observe(None, 0, 0, 0, 0.0, T1)
    keyed, pooled = p.est["lookup@x"], p.est["lookup"]
    # keyed shadows: at 9 (miss), 10 (hit: 11 is skipped), 12 (hit: 13 skipped), 14 (miss); pooled: all of 9..14
    assert keyed.tried[0] == pytest.approx(sum(0.9 ** i for i in range(4)))
    assert keyed.acc[0] == pytest.approx(0.9 ** 1 + 0.9 ** 2)
    assert pooled.tried[0] == pytest.approx(sum(0.9 ** i for i in range(6)))

    # a skipped step that drafts is judged by its key
    p2 = AdaptivePolicy({"lookup": lk}, k_max=4, cost_prior={"lookup": 0.0}, verify_prior={b: 1.0 for b in range(1, 10)})
    p2.observe(None, 0, 0, 0, 0.0, T1)
    for n in (10, 11):  # flat curve: both steps draft
        drafter, k = p2.choose(answer[:n])
        assert drafter is lk and k > 0
        p2.observe(drafter, k, k, 0, 0.0, T1)
    p2.choose(answer[:16])
    assert p2.est["lookup@x"].tried[0] == pytest.approx(1.9)  # positions 10 and 11, the latter covered but drafted


def test_an_offer_names_the_prior_its_estimate_starts_from():
    answer = list(range(100, 140))
    for prior, drafts in ((0.3, False), (0.95, True)):
        p = AdaptivePolicy({"lookup": ShadowLookup(answer, set(), prior)}, k_max=2, cost_prior={"lookup": 0.0},
                           verify_prior={1: 1.0, 2: 1.75, 3: 2.25})
        p.observe(None, 0, 0, 0, 0.0, T1)
        drafter, k = p.choose(answer[:5])
        assert (drafter is not None and k > 0) == drafts
        assert p.est["lookup@x"].prior_alpha == prior


def test_a_deep_position_ages_while_position_zero_is_judged():
    """A deeper position is tried only after the ones before it were accepted: its figures age with every judgement of
    position 0, so a copy's early successes there do not outlive the prose after it, where position 0 keeps failing."""
    est = DrafterEstimate(prior_alpha=0.5)
    for _ in range(4):
        est.observe(3, 3, None)  # a copy: every position accepted
    copy_deep = est.alphas(3)[2]
    for _ in range(10):
        est.observe(3, 0, None)  # prose: the first token fails, positions 1 and 2 are never tried
    a0, _, a2 = est.alphas(3)
    assert copy_deep > 0.95
    assert a0 < 0.3
    assert a2 < 0.75  # on its way back to its prior (position 1's figure); left alone, it kept the copy's 0.97


def test_a_calibration_flatter_than_the_machine_is_corrected_by_the_runs_own_verify_steps():
    """One calibration, taken in a few seconds, can read a verify batch's extra cost well under what the machine then
    pays (measured: 1.55 one-token decodes for 2 rows, where the run's steps paid 1.7-1.8). On such a curve a
    prose match drafted at acceptance 0.55 looks like a gain and is a loss: once the run's own verify steps show the
    extra cost at twice the calibrated one, the controller stops drafting them. Within the live band the scale stays
    put (test_decisions_do_not_swing_with_timing_noise_when_the_curve_is_calibrated)."""
    calibrated = {b: 1 + 0.3 * (b - 1) for b in range(1, 10)}
    machine = lambda b: T1 * (1 + 0.6 * (b - 1))  # noqa: E731

    class Lookup(FakeLookup):
        def match(self, context, k):
            self.n = getattr(self, "n", 0) + 1
            return ([7] * k, 4) if self.n % 3 else ([], 0)  # now and then no match: a plain step

    def run(prior):
        p = AdaptivePolicy({"lookup": Lookup()}, k_max=4, cost_prior={"lookup": 0.0}, verify_prior=prior)
        return p, simulate(p, lambda s: 0.55, 0.0, machine, 300, np.random.default_rng(4), name="lookup")

    p, ks = run(calibrated)
    right, ks_right = run({b: machine(b) / T1 for b in range(1, 10)})
    drafted = lambda ks: np.mean([k > 0 for k in ks])  # noqa: E731
    assert drafted(ks[:12]) > 0.5  # on the calibration as taken, drafting looks like a gain
    assert p.curve.scale == pytest.approx(2.0, rel=0.05) and right.curve.scale == 1.0
    assert p.curve.cost(3) == pytest.approx(machine(3), rel=0.05)
    # ... and once the steps showed what it costs, it drafts as rarely as on the right curve (a probe now and then)
    assert drafted(ks[100:]) <= drafted(ks_right[100:]) + 0.03 < 0.3
