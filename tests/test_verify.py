"""The verifier is a pure function: tested without any model."""

import numpy as np
import pytest

from localspec.sample.sampling import Draws, SamplingParams, probs, sample, token_logprobs
from localspec.sample.verify import NO_TOKEN, greedy_verify, keyed_verify, one_hot, speculative_sampling


def test_greedy_accepts_prefix_then_target_token():
    assert greedy_verify([5, 6, 7], [5, 6, 9, 1]) == (2, 9)
    assert greedy_verify([5, 6, 7], [5, 6, 7, 1]) == (3, 1)  # all accepted: bonus token
    assert greedy_verify([5], [4, 0]) == (0, 4)
    assert greedy_verify([], [3]) == (0, 3)


def test_a_row_with_no_token_left_ends_the_step():
    """logit_bias and a grammar can exclude every token of a row: its draft is rejected and nothing is drawn there."""
    assert greedy_verify([5, 6], [5, NO_TOKEN, 2]) == (1, NO_TOKEN)
    assert greedy_verify([5], [5, NO_TOKEN]) == (1, NO_TOKEN)
    dead = np.full(6, -np.inf)
    for sp in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, top_k=2)):
        assert not probs(dead, sp).any()  # zeros, not NaN
    p = np.stack([P[0], probs(dead, SamplingParams(temperature=1.0)), P[1]])
    rng = np.random.default_rng(0)
    for _ in range(50):
        assert speculative_sampling([0, 1], one_hot([0, 1], 6), p, rng)[1] in (NO_TOKEN, 1, 2, 3)
    assert speculative_sampling([4, 1], one_hot([4, 1], 6), p[[1, 0, 2]], rng) == (0, NO_TOKEN)
    assert speculative_sampling([0], one_hot([0], 6), np.stack([np.eye(6)[0], p[1]]), rng) == (1, NO_TOKEN)
    lp, top = token_logprobs(dead, 3, 5)  # finite numbers only: JSON has no NaN
    assert lp == -9999.0 and top == []


def test_greedy_rejects_wrong_row_count():
    with pytest.raises(ValueError):
        greedy_verify([1, 2], [1, 2])


def _emitted_first_token_freq(p, q, draft_sampler, trials, seed):
    """Frequency of the first emitted token after one speculative step with gamma = 1."""
    rng = np.random.default_rng(seed)
    V = p.shape[1]
    counts = np.zeros(V)
    for _ in range(trials):
        x = draft_sampler(rng)
        n, nxt = speculative_sampling([x], q, p, rng)
        counts[x if n == 1 else nxt] += 1
    return counts


def _chi2_ok(counts, expected_p):
    n = counts.sum()
    mask = expected_p > 0
    assert counts[~mask].sum() == 0, "emitted a token the target gives probability 0"
    e = expected_p[mask] * n
    chi2 = float(((counts[mask] - e) ** 2 / e).sum())
    dof = mask.sum() - 1
    # 99.9% quantile of chi-square is below dof + 4.5*sqrt(2 dof) + 10 for these small dofs
    return chi2 < dof + 4.5 * np.sqrt(2 * dof) + 10, chi2


P = np.array([[0.5, 0.2, 0.2, 0.1, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1, 0.3, 0.3]])


def test_stochastic_reproduces_p_with_mass_where_p_has_none():
    q = np.array([[0.1, 0.1, 0.1, 0.1, 0.3, 0.3]])  # q puts 60% where p has none
    counts = _emitted_first_token_freq(P, q, lambda r: sample(q[0], r), 20000, 0)
    ok, chi2 = _chi2_ok(counts, P[0])
    assert ok, chi2


def test_stochastic_reproduces_p_with_one_hot_q():
    q = one_hot([3], 6)  # a lookup draft: always proposes token 3
    counts = _emitted_first_token_freq(P, q, lambda r: 3, 20000, 1)
    ok, chi2 = _chi2_ok(counts, P[0])
    assert ok, chi2


def test_stochastic_detects_a_wrong_rule():
    """The chi-square check has power: always accepting the draft would fail it."""
    q = np.array([[0.1, 0.1, 0.1, 0.1, 0.3, 0.3]])
    rng = np.random.default_rng(2)
    counts = np.zeros(6)
    for _ in range(20000):
        counts[sample(q[0], rng)] += 1
    with pytest.raises(AssertionError):
        assert _chi2_ok(counts, P[0])[0]


def test_bonus_token_from_last_row_when_all_accepted():
    p = np.array([[0, 1.0, 0], [0, 0, 1.0]])
    q = one_hot([1], 3)
    n, nxt = speculative_sampling([1], q, p, np.random.default_rng(0))
    assert (n, nxt) == (1, 2)


def test_two_step_sequence_distribution():
    """gamma = 2: the joint distribution of the first two emitted tokens is p0(a) * p1(b)
    (p1 independent of a here), whatever q proposes."""
    p = np.array([[0.6, 0.4, 0.0], [0.2, 0.3, 0.5], [0.2, 0.3, 0.5]])
    q = np.array([[0.2, 0.2, 0.6], [0.5, 0.5, 0.0]])
    rng = np.random.default_rng(3)
    counts = np.zeros((3, 3))
    trials = 30000
    for _ in range(trials):
        d = [sample(q[0], rng), sample(q[1], rng)]
        n, nxt = speculative_sampling(d, q, p, rng)
        if n == 0:
            a = nxt
            b = sample(p[1], rng)  # plain decoding continues
        elif n == 1:
            a, b = d[0], nxt
        else:
            a, b = d[0], d[1]
        counts[a, b] += 1
    expected = np.outer(p[0], p[1]).ravel()
    ok, chi2 = _chi2_ok(counts.ravel(), expected)
    assert ok, chi2


# ----------------------------------------------------------------- keyed verification (seeded requests)
def _keyed_first_token_freq(p, draft, trials):
    """Frequency of the first emitted token after one keyed step with gamma = 1 (draft(draws, i): the draft)."""
    counts = np.zeros(p.shape[1])
    for t in range(trials):
        draws = Draws(t)
        x = draft(draws, t)
        n, nxt = keyed_verify([x], lambda i: p[i], draws, 0)
        counts[x if n == 1 else nxt] += 1
    return counts


@pytest.mark.parametrize("how", ["coupled", "independent", "one-hot", "mass where p has none"])
def test_keyed_reproduces_p_whatever_the_draft(how):
    q = np.array([0.4, 0.3, 0.1, 0.2, 0.0, 0.0]) if how != "mass where p has none" else P[1]
    rng = np.random.default_rng(7)
    draft = {"coupled": lambda d, t: sample(q, d.at(0)), "one-hot": lambda d, t: 3}.get(
        how, lambda d, t: sample(q, rng))
    counts = _keyed_first_token_freq(P, draft, 12000)
    ok, chi2 = _chi2_ok(counts, P[0])
    assert ok, chi2


def test_keyed_emits_the_targets_own_draws_whatever_the_drafts():
    """The tokens a keyed step emits are the target's draws at their positions, for any drafts: the same answer
    with every drafter and k."""
    p = np.array([[0.6, 0.4, 0.0], [0.2, 0.3, 0.5], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]])
    rng = np.random.default_rng(4)
    for seed in range(300):
        draws = Draws(seed)
        own = [draws.token(p[i], 10 + i) for i in range(4)]
        for gamma in range(4):
            d = [int(x) for x in rng.integers(0, 3, gamma)] if seed % 2 else own[:gamma]
            n, nxt = keyed_verify(d, lambda i: p[i], draws, 10)
            assert d[:n] + [nxt] == own[:n + 1]
            assert n == gamma or d[n] != own[n]


def test_keyed_draws_depend_on_seed_and_position_only():
    p = np.array([0.25, 0.25, 0.25, 0.25])
    a, b = Draws(3), Draws(3)
    assert [a.token(p, i) for i in range(40)] == [b.token(p, i) for i in reversed(range(40))][::-1]
    assert [a.token(p, i) for i in range(40)] != [Draws(4).token(p, i) for i in range(40)]
    cursor = a.at(7)  # what drafters sample with: consecutive positions
    assert [sample(p, cursor) for _ in range(5)] == [a.token(p, 7 + i) for i in range(5)]
    with pytest.raises(ValueError):
        a.token(np.zeros(4), 0)
    assert keyed_verify([1], lambda i: np.zeros(4), a, 0) == (0, NO_TOKEN)


def test_coupled_drafts_are_accepted_about_as_often_as_leviathans():
    """A draft sampled with the target's draws is accepted with the Gumbel coupling's chance: at least
    (1 - tv) / (1 + tv), near Leviathan's 1 - tv when q is close to p."""
    p = np.array([0.5, 0.2, 0.2, 0.1, 0.0, 0.0])
    q = np.array([0.45, 0.25, 0.15, 0.1, 0.05, 0.0])
    tv = 0.5 * np.abs(p - q).sum()
    hits = sum(sample(q, Draws(t).at(0)) == Draws(t).token(p, 0) for t in range(4000)) / 4000
    assert hits >= (1 - tv) / (1 + tv) - 0.02 and hits <= 1 - tv + 0.02


def test_probs_shapes_distribution():
    logits = np.array([3.0, 2.0, 1.0, 0.0, -1.0])
    g = probs(logits, SamplingParams(temperature=0))
    assert g.tolist() == [1, 0, 0, 0, 0]
    p = probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert np.count_nonzero(p) == 2 and abs(p.sum() - 1) < 1e-12
    p = probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert np.count_nonzero(p) == 1
    p = probs(logits, SamplingParams(temperature=1.0, min_p=0.3))
    assert np.count_nonzero(p) == 2  # e^-1 = 0.37 >= 0.3, e^-2 < 0.3
    hot = probs(logits, SamplingParams(temperature=0.1))
    assert hot[0] > 0.99


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(temperature=float("nan")), dict(top_p=0), dict(min_p=1.0), dict(top_k=-1)])
def test_bad_sampling_params(kw):
    from localspec.errors import UsageError

    with pytest.raises(UsageError):
        SamplingParams(**kw)
