"""What an audit can show: the most it can prove, what a correct run shows, and the advice."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest

from opake.auditing import (
    AuditResult,
    GradientCanaries,
    SubsampledGaussian,
    canaries_needed,
    draw_inclusion,
    epsilon_lower_bound,
    expected_lower_bound,
    max_provable_bound,
    one_run_audit,
    self_test,
    simulate_gaussian_audit,
)
from opake.auditing._guesses import GROUP_GUESS_FRACTION, GUESS_FRACTIONS
from opake.auditing._simulate import gaussian_epsilon
from opake.core.errors import ConfigurationError, InputTypeError


def _perfect_by_hand(truth, labels, *, attacks, delta, confidence=0.95):
    """Every try of the default design, each guess right when the scores separate in from out
    perfectly: k "in" right up to the included count, k "out" up to the excluded count."""
    m = len(truth)
    tries = []
    ks = sorted({max(1, min(m // 2, round(f * m))) for f in GUESS_FRACTIONS})
    tries += [(np.arange(m), k) for k in ks if 2 * k <= m]
    for name in dict.fromkeys(labels):
        members = np.flatnonzero(np.asarray(labels) == name)
        k = min(len(members) // 2, round(GROUP_GUESS_FRACTION * len(members)))
        tries.append((members, k))
    level = 1 - (1 - confidence) / (len(tries) * attacks)
    bounds = []
    for members, k in tries:
        n_in = int(truth[members].sum())
        correct = min(k, n_in) + min(k, len(members) - n_in)
        bounds.append(
            epsilon_lower_bound(
                canaries=m, guesses=2 * k, correct=correct, delta=delta, confidence=level
            )
        )
    return max(bounds)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_most_provable_is_what_a_perfect_attack_reports(seed):
    m = 200
    truth = draw_inclusion(m, seed=seed)
    labels = GradientCanaries(m, seed=0).labels
    perfect = truth.astype(float)
    scores = {"a": perfect, "b": perfect, "c": perfect}  # three attacks share β
    result = one_run_audit(scores, truth, claimed_epsilon=1.0, delta=1e-5, groups=labels)
    by_hand = _perfect_by_hand(truth, labels, attacks=3, delta=1e-5)
    assert result.max_provable == pytest.approx(by_hand, abs=1e-6)
    assert result.epsilon_lower_bound == pytest.approx(result.max_provable, abs=1e-6)
    assert result.max_provable_guesses == (result.correct, result.guesses)
    # no scores do better: a strong but imperfect attack stays below
    noisy = perfect + np.random.default_rng(seed).normal(0, 0.3, m)
    weaker = one_run_audit(noisy, truth, claimed_epsilon=1.0, delta=1e-5, groups=labels)
    assert weaker.epsilon_lower_bound <= weaker.max_provable
    # before the draw: every guess right, the design's upper end
    design = max_provable_bound(canaries=m, delta=1e-5, groups=labels, attacks=3)
    assert result.max_provable <= design
    level = 1 - 0.05 / result.tries
    assert design == pytest.approx(
        epsilon_lower_bound(canaries=m, guesses=m, correct=m, delta=1e-5, confidence=level)
    )


def test_the_canaries_needed_are_enough_and_the_count_before_is_not():
    """Checked against perfect attacks on real inclusion draws (one attack, the grid)."""
    claim = 3.0
    needed = canaries_needed(claim, delta=1e-5, tries=7)
    assert needed == 200
    for seed in range(5):
        for m, above in ((needed, True), (100, False)):
            truth = draw_inclusion(m, seed=seed)
            result = one_run_audit(truth * 1.0, truth, claimed_epsilon=claim, delta=1e-5)
            assert (result.epsilon_lower_bound > claim) is above
    assert canaries_needed(30.0, delta=1e-5, tries=7) is None  # beyond any practical audit


def test_without_subsampling_the_expected_bound_is_the_ideal_gaussian_audit():
    """q = 1, one step: a canary's score is N(1, σ²) in, N(0, σ²) out — the Gaussian mechanism
    with μ = 1/σ, which ``simulate_gaussian_audit`` (its own implementation) audits."""
    sigma, delta, m = 1.0, 1e-5, 300
    epsilon = gaussian_epsilon(1 / sigma, delta)  # 4.38
    mechanism = SubsampledGaussian(noise_multiplier=sigma, sample_rate=1.0, steps=1)
    ours = expected_lower_bound(
        mechanism, canaries=m, delta=delta, attacks=["score"], simulations=7
    )
    ideal = [
        simulate_gaussian_audit(epsilon, canaries=m, delta=delta, seed=100 + s).epsilon_lower_bound
        for s in range(7)
    ]
    assert statistics.median(ours) == pytest.approx(statistics.median(ideal), abs=0.3)
    assert 0.5 < statistics.median(ours) < epsilon


def test_simulated_scores_match_a_real_dpsgd_run():
    """The canaries of a real DP-SGD run (the self-test, through DPTraining) against the
    mechanism at its σ, q and T: the all-steps scores have the theory's moments (out: N(0,
    σ²T); in: mean qT, variance σ²T + q(1 − q)T), and each attack's scores, in and out, pass a
    two-sample KS test against the simulation; the same test rejects a simulation at 2σ (so it
    can fail)."""
    from scipy import stats

    real = self_test(canaries=600, steps=25, sample_rate=0.1, engine="vmap", crafted=False, seed=0)
    truth = np.asarray(real.included)
    sigma, q, steps = (real.extra[k] for k in ("noise_multiplier", "sample_rate", "steps"))
    totals = np.asarray(real.scores["all_steps"])
    for side, mean, var in (
        (~truth, 0.0, sigma**2 * steps),
        (truth, q * steps, sigma**2 * steps + q * (1 - q) * steps),
    ):
        n = int(side.sum())
        assert abs(totals[side].mean() - mean) < 4 * math.sqrt(var / n)
        assert abs(totals[side].var() / var - 1) < 4 * math.sqrt(2 / n)
    rng = np.random.default_rng(0)

    def simulated(noise):
        return SubsampledGaussian(noise, q, steps).scores(
            truth, ["all_steps", "likelihood_ratio"], rng
        )

    right, wrong = simulated(sigma), simulated(2 * sigma)
    for attack in ("all_steps", "likelihood_ratio"):
        scores = np.asarray(real.scores[attack])
        for side in (truth, ~truth):
            assert stats.ks_2samp(scores[side], right[attack][side]).pvalue > 1e-3
            assert stats.ks_2samp(scores[side], wrong[attack][side]).pvalue < 1e-3


def test_the_guides_settings_show_nothing_and_say_why():
    """``--target-epsilon 2 --steps 20`` on the default corpus (q = 0.0195, σ = 0.96): a correct
    run shows ≈ 0 because most canaries are never drawn; the advice says more steps."""
    mechanism = SubsampledGaussian(noise_multiplier=0.96, sample_rate=0.0195, steps=20)
    truth = draw_inclusion(1000, seed=0)
    scores = mechanism.scores(truth, ["all_steps"], np.random.default_rng(1))
    result = one_run_audit(
        scores, truth, claimed_epsilon=2.0, delta=2.3e-8, kind="gradient", mechanism=mechanism
    )
    assert result.expected_if_correct is not None
    assert result.expected_if_correct < 0.05
    assert result.simulations == 9
    assert result.max_provable > 2.0  # a gross fault could still show
    assert [a.change for a in result.advice] == ["steps"]
    assert result.advice[0].value == math.ceil(5 / 0.0195)
    assert "a correct run shows ≈ 0" in result.verdict
    lines = result.explain(options={"steps": "--steps"})
    assert lines[0].startswith("at most: ε ≥ ")
    assert lines[1].startswith("expected: a run that exactly meets the claim shows ε ≥ 0.0")
    assert "q·T = 0.39" in lines[-1]
    assert lines[-1].endswith("(--steps 257)")


def test_a_claim_beyond_the_most_provable_is_said_so():
    truth = draw_inclusion(1000, seed=0)
    scores = truth + np.random.default_rng(0).normal(0, 2.0, 1000)
    result = one_run_audit(scores, truth, claimed_epsilon=8.0, delta=1e-8, kind="input")
    assert result.expected_if_correct is None
    assert result.max_provable < 8.0
    assert "none could show" in result.verdict
    changes = {a.change: a for a in result.advice}
    assert set(changes) == {"claim", "canaries", "canary_kind"}
    assert changes["claim"].value == 2.0  # about half of the most provable
    assert changes["canaries"].value == canaries_needed(8.0, delta=1e-8, tries=result.tries)
    data = json.loads(json.dumps(result.to_dict(with_scores=False)))
    assert data["max_provable_epsilon"] == result.max_provable
    assert data["verdict"] == result.verdict
    assert [a["change"] for a in data["advice"]] == ["claim", "canaries", "canary_kind"]
    assert data["explanation"] == result.explain()


def test_an_informative_audit_gets_no_advice():
    mechanism = SubsampledGaussian(noise_multiplier=1.0, sample_rate=0.1, steps=50)
    truth = draw_inclusion(500, seed=3)
    scores = mechanism.scores(truth, ["all_steps"], np.random.default_rng(3))
    result = one_run_audit(scores, truth, claimed_epsilon=2.0, delta=1e-5, mechanism=mechanism)
    assert result.advice == ()
    assert result.expected_if_correct > 0.05
    assert result.verdict == "no violation found (not a proof of privacy)"
    low, high = result.expected_range
    assert low <= result.expected_if_correct <= high


def test_a_result_built_by_hand_explains_nothing():
    result = AuditResult(claimed_epsilon=1.0, delta=0.0, epsilon_lower_bound=0.0, confidence=0.95,
                         canaries=10, guesses=2, correct=1)  # fmt: skip
    assert result.explain() == []
    assert result.to_dict()["max_provable_epsilon"] is None


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"noise_multiplier": 0.0, "sample_rate": 0.1, "steps": 1}, ConfigurationError),
        ({"noise_multiplier": "1", "sample_rate": 0.1, "steps": 1}, InputTypeError),
        ({"noise_multiplier": 1.0, "sample_rate": 1.5, "steps": 1}, ConfigurationError),
        ({"noise_multiplier": 1.0, "sample_rate": 0.1, "steps": 0}, ConfigurationError),
    ],
)
def test_bad_mechanisms_are_refused(kwargs, error):
    with pytest.raises(error):
        SubsampledGaussian(**kwargs)


def test_bad_arguments_are_refused():
    truth = draw_inclusion(20, seed=0)
    with pytest.raises(ConfigurationError, match="mechanism="):
        one_run_audit(truth * 1.0, truth, claimed_epsilon=1.0, delta=0.0, mechanism=(1, 0.1, 3))
    with pytest.raises(ConfigurationError, match="attacks="):
        max_provable_bound(canaries=20, delta=0.0, attacks=0)
    with pytest.raises(ConfigurationError, match="included has 3"):
        max_provable_bound(canaries=20, delta=0.0, included=[True, False, True])
    with pytest.raises(ConfigurationError, match="simulations="):
        expected_lower_bound(SubsampledGaussian(1.0, 0.1, 2), canaries=20, delta=0.0, simulations=0)


def test_audit_passes_the_mechanism_through():
    import torch

    from opake.auditing import InputCanaries, audit

    mechanism = SubsampledGaussian(noise_multiplier=1.0, sample_rate=0.1, steps=20)
    result = audit(
        lambda examples: set(examples.tolist()),
        InputCanaries(torch.arange(100.0)),
        claimed_epsilon=1.0,
        delta=1e-5,
        score=lambda kept, examples: np.array([float(x in kept) for x in examples.tolist()]),
        seed=0,
        mechanism=mechanism,
    )
    assert result.mechanism == mechanism
    assert result.expected_if_correct is not None
    assert not result.consistent  # the "mechanism" publishes its data
    assert result.verdict.startswith("VIOLATION")
    assert result.advice == ()  # a violation needs no advice
    assert result.explain()[-1].startswith("reading: the bound ")
