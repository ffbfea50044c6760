"""Monte-Carlo: the bound is valid (rarely above the truth) and has power, on ideal mechanisms."""

from __future__ import annotations

import math

import numpy as np
import pytest

from opake.auditing import epsilon_lower_bound, one_run_audit, p_value, simulate_gaussian_audit
from opake.auditing._simulate import _mu_for, gaussian_epsilon


def test_p_value_dominates_the_tail_of_randomized_response():
    # ε-randomized response is the tight case of Theorem 3 (δ = 0): P[W >= v] equals the bound
    rng = np.random.default_rng(0)
    eps, r, trials = 1.0, 50, 20000
    q = 1 / (1 + math.exp(-eps))
    correct = rng.binomial(r, q, size=trials)
    for v in (30, 35, 40, 45):
        empirical = float((correct >= v).mean())
        bound = p_value(canaries=r, guesses=r, correct=v, epsilon=eps)
        assert empirical <= bound + 4 * math.sqrt(bound * (1 - bound) / trials) + 1e-4


def test_randomized_response_bound_exceeds_the_truth_at_most_beta_of_the_time():
    rng = np.random.default_rng(1)
    eps, m, trials = 2.0, 100, 2000
    q = 1 / (1 + math.exp(-eps))
    correct = rng.binomial(m, q, size=trials)
    cache = {
        int(v): epsilon_lower_bound(canaries=m, guesses=m, correct=int(v), delta=0.0)
        for v in np.unique(correct)
    }
    exceed = float(np.mean([cache[int(v)] > eps for v in correct]))
    # β = 0.05, tight mechanism: the rate is at most β (plus Monte-Carlo error)
    assert exceed <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)


def test_gaussian_epsilon_agrees_with_the_accountant():
    from opake import accounting

    for sigma in (0.5, 1.0, 2.0):
        eps = accounting.epsilon(sample_rate=1.0, noise_multiplier=sigma, steps=1, delta=1e-5)
        assert gaussian_epsilon(1 / sigma, 1e-5) == pytest.approx(eps, rel=2e-3)
    assert gaussian_epsilon(_mu_for(4.0, 1e-5), 1e-5) == pytest.approx(4.0, rel=1e-6)


@pytest.mark.parametrize("epsilon", [1.0, 4.0, 8.0])
def test_gaussian_audits_never_exceed_the_true_epsilon(epsilon):
    bounds = [
        simulate_gaussian_audit(epsilon, canaries=500, seed=s).epsilon_lower_bound
        for s in range(10)
    ]
    assert max(bounds) <= epsilon


def test_gaussian_audit_has_power_at_a_large_epsilon():
    result = simulate_gaussian_audit(8.0, canaries=1000, seed=3)
    assert result.epsilon_lower_bound > 2.0


def test_an_over_claimed_gaussian_is_caught():
    # the mechanism is really ε = 8 but claims 1: the audit proves the claim wrong
    result = simulate_gaussian_audit(8.0, canaries=1000, seed=4)
    claimed = one_run_audit(
        result.scores["score"], result.included, claimed_epsilon=1.0, delta=1e-5
    )
    assert not claimed.consistent
