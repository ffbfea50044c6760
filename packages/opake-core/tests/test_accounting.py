"""Tests for opake.accounting against Google's dp-accounting and closed-form references."""

from __future__ import annotations

import json
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as dpa_pld
from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate, stats

from opake import accounting
from opake.accounting import (
    PLDAccountant,
    RDPAccountant,
    accountant_from_state_dict,
    calibrate_noise,
    epsilon,
    make_accountant,
)
from opake.accounting._pld import DiscretePLD, subsampled_gaussian_delta, subsampled_gaussian_pld
from opake.accounting._rdp import DEFAULT_RDP_ORDERS, subsampled_gaussian_rdp
from opake.core.errors import ConfigurationError, InputTypeError

FAST = {"value_discretization_interval": 1e-3}

# (q, σ, steps, δ): small and large q, noise from 0.6 to 5, 10 to 10 000 steps.
CASES = [
    (0.01, 1.0, 1000, 1e-5),
    (0.001, 0.6, 10_000, 1e-6),
    (0.1, 2.0, 100, 1e-5),
    (1.0, 5.0, 10, 1e-5),
    (0.004, 1.1, 5000, 1e-5),
]


def _event(q: float, sigma: float) -> dp_accounting.DpEvent:
    return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))


def _rel(a: float, b: float) -> float:
    return abs(a / b - 1.0)


# -- RDP ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("q", "sigma", "steps", "delta"), CASES)
def test_rdp_matches_dp_accounting(q: float, sigma: float, steps: int, delta: float) -> None:
    ours = RDPAccountant()
    ours.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    ref = dpa_rdp.RdpAccountant()
    ref.compose(_event(q, sigma), steps)
    assert _rel(ours.get_epsilon(delta), ref.get_epsilon(delta)) < 0.01
    # The orders' RDP values themselves agree to rounding (same formulas, same grid).
    np.testing.assert_allclose(ours.rdp(), np.asarray(ref._rdp), rtol=1e-8)
    eps = ref.get_epsilon(delta)
    assert _rel(ours.get_delta(eps), ref.get_delta(eps)) < 0.01


def test_rdp_matches_direct_expectation() -> None:
    # Slow obvious reference: A_α = E_{x~N(0,σ²)}[(1 - q + q·exp((2x-1)/(2σ²)))^α] by quadrature.
    q, sigma = 0.05, 0.9

    def direct(alpha: float) -> float:
        def integrand(x: float) -> float:
            ratio = 1 - q + q * math.exp((2 * x - 1) / (2 * sigma**2))
            return float(stats.norm.pdf(x, scale=sigma) * ratio**alpha)

        # The integrand is a Gaussian bump centred near x = α·(mixture weight): give quad the
        # point and tight tolerances.
        a_alpha, _ = integrate.quad(
            integrand, -20 * sigma, 20 * sigma + alpha, points=[0.0, 1.0, alpha], limit=400,
            epsabs=0.0, epsrel=1e-12,
        )  # fmt: skip
        return math.log(a_alpha) / (alpha - 1)

    for alpha in (2.0, 3.0, 8.0, 17.0):  # integer orders: exact
        assert float(subsampled_gaussian_rdp(q, sigma, [alpha])[0]) == pytest.approx(
            direct(alpha), rel=1e-9
        )
    for alpha in (1.5, 2.5, 3.5, 10.5):  # fractional: Σ|terms| is an upper bound
        got = float(subsampled_gaussian_rdp(q, sigma, [alpha])[0])
        assert got >= direct(alpha) * (1 - 1e-9)
        assert got == pytest.approx(
            float(dpa_rdp._compute_rdp_poisson_subsampled_gaussian(q, sigma, [alpha])[0]),
            rel=1e-9,
        )


def test_rdp_orders_option_and_q_one() -> None:
    acc = RDPAccountant(orders=[2.0, 4.0, 8.0])
    acc.step(noise_multiplier=2.0, sample_rate=1.0, num_steps=3)
    np.testing.assert_allclose(acc.rdp(), 3 * np.array([2.0, 4.0, 8.0]) / 8.0)
    assert acc.orders == (2.0, 4.0, 8.0)
    assert accountant_from_state_dict(acc.state_dict()).orders == (2.0, 4.0, 8.0)


@settings(max_examples=20, deadline=None)
@given(
    q=st.floats(1e-3, 0.5),
    sigma=st.floats(0.8, 5.0),
    steps=st.integers(1, 5000),
)
def test_rdp_epsilon_monotone(q: float, sigma: float, steps: int) -> None:
    # Within the regime of DP training (q ≤ 0.75 here). Near q = 1 with ε in the hundreds the
    # fractional orders' upper bound (Σ|terms|) can exceed the exact q = 1 value, so the bound
    # is not monotone in q there — both remain valid upper bounds.
    def eps(**kw: float) -> float:
        args = {"sample_rate": q, "noise_multiplier": sigma, "steps": steps, **kw}
        return epsilon(delta=1e-5, accountant="rdp", **args)  # type: ignore[arg-type]

    base = eps()
    assert eps(noise_multiplier=sigma * 1.2) <= base + 1e-12
    assert eps(steps=steps * 2) >= base - 1e-12
    assert eps(sample_rate=min(1.0, q * 1.5)) >= base - 1e-12


# -- PLD ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("q", "sigma", "steps", "delta"), CASES)
def test_pld_matches_dp_accounting_same_grid(
    q: float, sigma: float, steps: int, delta: float
) -> None:
    ref = dpa_pld.from_gaussian_mechanism(
        sigma, value_discretization_interval=1e-3, sampling_prob=q
    ).self_compose(steps)
    ours = PLDAccountant(**FAST)
    ours.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    assert _rel(ours.get_epsilon(delta), ref.get_epsilon_for_delta(delta)) < 0.01
    eps = ref.get_epsilon_for_delta(delta)
    assert _rel(ours.get_delta(eps), ref.get_delta_for_epsilon(eps)) < 0.01


@pytest.mark.parametrize(("q", "sigma", "steps", "delta"), CASES[:3])
def test_pld_round_up_matches_dp_accounting_privacy_buckets(
    q: float, sigma: float, steps: int, delta: float
) -> None:
    ref = dpa_pld.from_gaussian_mechanism(
        sigma, value_discretization_interval=1e-3, sampling_prob=q, use_connect_dots=False
    ).self_compose(steps)
    ours = PLDAccountant(value_discretization_interval=1e-3, discretization="round_up")
    ours.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    assert _rel(ours.get_epsilon(delta), ref.get_epsilon_for_delta(delta)) < 0.01


def test_pld_coarse_grid_within_one_percent_of_dp_accounting_default() -> None:
    # dp-accounting's own accountant at its default grid (1e-4) against ours at 1e-3.
    q, sigma, steps, delta = 0.01, 1.0, 1000, 1e-5
    ref = dp_accounting.pld.PLDAccountant()
    ref.compose(_event(q, sigma), steps)
    assert _rel(epsilon(sample_rate=q, noise_multiplier=sigma, steps=steps, delta=delta,
                        accountant_options=FAST), ref.get_epsilon(delta)) < 0.01  # fmt: skip


def test_pld_upper_bounds_the_exact_gaussian_and_is_tight() -> None:
    # q = 1: k steps of σ are one Gaussian mechanism with σ/√k; δ(ε) has a closed form
    # (Balle & Wang 2018): δ = Φ(1/(2s) - εs) - e^ε Φ(-1/(2s) - εs).
    sigma, steps, delta = 3.0, 20, 1e-6
    s = sigma / math.sqrt(steps)

    def exact_delta(eps: float) -> float:
        return float(
            stats.norm.cdf(0.5 / s - eps * s) - math.exp(eps) * stats.norm.cdf(-0.5 / s - eps * s)
        )

    from scipy.optimize import brentq

    exact = brentq(lambda e: exact_delta(e) - delta, 0.0, 100.0, xtol=1e-12)
    acc = PLDAccountant(**FAST)
    acc.step(noise_multiplier=sigma, sample_rate=1.0, num_steps=steps)
    got = acc.get_epsilon(delta)
    assert exact <= got <= exact * 1.005
    assert acc.get_delta(exact) >= delta * (1 - 1e-9)  # pessimistic in δ too


@pytest.mark.parametrize("direction", ["remove", "add"])
@pytest.mark.parametrize(("q", "sigma"), [(0.02, 0.8), (0.3, 1.5), (1.0, 1.0)])
def test_single_step_delta_matches_hockey_stick_integral(
    direction: str, q: float, sigma: float
) -> None:
    # Reference: δ(ε) = ∫ (p(x) - e^ε·q(x))_+ dx by quadrature over the two mixtures.
    def mixture(x: float) -> float:
        return float((1 - q) * stats.norm.pdf(x, scale=sigma) + q * stats.norm.pdf(x, 1.0, sigma))

    def base(x: float) -> float:
        return float(stats.norm.pdf(x, scale=sigma))

    upper, lower = (mixture, base) if direction == "remove" else (base, mixture)
    for eps in (0.0, 0.05, 0.5, 2.0):
        ref, _ = integrate.quad(
            lambda x, e=eps: max(0.0, upper(x) - math.exp(e) * lower(x)),
            -15 * sigma,
            15 * sigma + 1,
            limit=400,
            points=[0.0, 0.5, 1.0],
            epsabs=1e-15,
            epsrel=1e-11,
        )
        got = float(subsampled_gaussian_delta([eps], sigma, q, direction)[0])  # type: ignore[arg-type]
        assert got == pytest.approx(ref, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("discretization", ["connect_dots", "round_up"])
def test_discrete_pld_is_pessimistic_per_step(discretization: str) -> None:
    sigma, q, interval = 1.0, 0.05, 1e-2
    for direction in ("remove", "add"):
        pld = subsampled_gaussian_pld(sigma, q, interval, direction, discretization)  # type: ignore[arg-type]
        assert pld.probs.sum() + pld.infinity_mass == pytest.approx(1.0, abs=1e-9)
        for eps in np.linspace(0.0, 1.5, 31):
            exact = float(subsampled_gaussian_delta([eps], sigma, q, direction)[0])  # type: ignore[arg-type]
            assert pld.delta_for_epsilon(float(eps)) >= exact - 1e-12


def test_epsilon_for_delta_matches_brute_force_inverse() -> None:
    pld = subsampled_gaussian_pld(0.9, 0.05, 1e-2, "remove").self_compose(50)
    for delta in (1e-3, 1e-5, 1e-7):
        eps = pld.epsilon_for_delta(delta)
        # δ(ε) is decreasing: the answer meets δ and anything 1e-9 smaller does not.
        assert pld.delta_for_epsilon(eps) <= delta * (1 + 1e-9)
        assert pld.delta_for_epsilon(eps - 1e-6) > delta
    big = DiscretePLD(0.1, 0, np.array([0.5, 0.4]), 0.1)
    assert big.epsilon_for_delta(0.05) == math.inf
    assert DiscretePLD.identity(0.1).epsilon_for_delta(1e-5) == 0.0


def test_self_composition_matches_repeated_composition() -> None:
    single = subsampled_gaussian_pld(1.0, 0.1, 1e-2, "remove")
    by_fft = single.self_compose(8)
    by_loop = single
    for _ in range(7):
        by_loop = by_loop.compose(single)
    for delta in (1e-4, 1e-6):
        assert by_fft.epsilon_for_delta(delta) == pytest.approx(
            by_loop.epsilon_for_delta(delta), rel=1e-6
        )


def test_pld_tighter_than_rdp() -> None:
    for q, sigma, steps, delta in CASES:
        kw = {"sample_rate": q, "noise_multiplier": sigma, "steps": steps, "delta": delta}
        pld = epsilon(accountant="pld", accountant_options=FAST, **kw)  # type: ignore[arg-type]
        rdp = epsilon(accountant="rdp", **kw)  # type: ignore[arg-type]
        assert pld < rdp


# -- schedules --------------------------------------------------------------------------------

PHASES = [(1.0, 0.01, 300), (0.8, 0.02, 200), (1.5, 0.005, 1000)]


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_heterogeneous_phases_match_dp_accounting(kind: str) -> None:
    ours = make_accountant(kind, **(FAST if kind == "pld" else {}))
    ref = (
        dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
        if kind == "pld"
        else dpa_rdp.RdpAccountant()
    )
    for sigma, q, steps in PHASES:
        ours.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
        ref.compose(_event(q, sigma), steps)
    assert len(ours.history) == 3
    assert ours.steps == 1500
    for delta in (1e-5, 1e-7):
        assert _rel(ours.get_epsilon(delta), ref.get_epsilon(delta)) < 0.01
    assert _rel(ours.get_delta(2.0), ref.get_delta(2.0)) < 0.01


def test_phase_order_does_not_matter_and_steps_merge() -> None:
    a, b = PLDAccountant(**FAST), PLDAccountant(**FAST)
    for sigma, q, steps in PHASES:
        a.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    for sigma, q, steps in reversed(PHASES):
        for _ in range(2):
            b.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps // 2)
    assert [p.num_steps for p in b.history] == [1000, 200, 300]
    assert a.get_epsilon(1e-5) == pytest.approx(b.get_epsilon(1e-5), rel=1e-9)
    c = RDPAccountant()
    c.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=0)
    assert c.history == ()
    assert c.get_epsilon(1e-5) == 0.0
    assert c.get_delta(1.0) == 0.0
    c.step(noise_multiplier=1.0, sample_rate=0.01)
    c.reset()
    assert c.steps == 0


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_state_dict_json_round_trip_restores_history(kind: str) -> None:
    acc = make_accountant(kind, **(FAST if kind == "pld" else {}))
    for sigma, q, steps in PHASES:
        acc.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    acc.step(
        noise_multiplier=1.2,
        sample_rate=0.01,
        num_steps=10,
        count_noise_multiplier=20.0,
        max_batch_size=300,
        dataset_size=10_000,
    )
    state = json.loads(json.dumps(acc.state_dict()))
    clone = accountant_from_state_dict(state)
    assert type(clone) is type(acc)
    assert clone.history == acc.history
    assert clone.get_epsilon(1e-5) == acc.get_epsilon(1e-5)
    same = make_accountant(kind, **(FAST if kind == "pld" else {}))
    same.load_state_dict(state)
    assert same.history == acc.history
    # A resumed accountant continues: one more step equals the uninterrupted history.
    acc.step(noise_multiplier=1.0, sample_rate=0.01)
    same.step(noise_multiplier=1.0, sample_rate=0.01)
    assert same.get_epsilon(1e-5) == acc.get_epsilon(1e-5)


def test_state_dict_mismatches_are_refused() -> None:
    pld = PLDAccountant(**FAST)
    pld.step(noise_multiplier=1.0, sample_rate=0.01)
    with pytest.raises(ConfigurationError, match="kind"):
        RDPAccountant().load_state_dict(pld.state_dict())
    with pytest.raises(ConfigurationError, match="options"):
        PLDAccountant().load_state_dict(pld.state_dict())
    with pytest.raises(ConfigurationError, match="version"):
        PLDAccountant(**FAST).load_state_dict({**pld.state_dict(), "version": 7})
    with pytest.raises(ConfigurationError, match="lacks"):
        PLDAccountant(**FAST).load_state_dict({"kind": "pld"})
    with pytest.raises(ConfigurationError, match="lacks"):
        accounting.Phase.from_dict({"noise_multiplier": 1.0})
    with pytest.raises(ConfigurationError):
        accountant_from_state_dict({"kind": "moments"})
    with pytest.raises(InputTypeError):
        accountant_from_state_dict([])  # type: ignore[arg-type]
    bad = pld.state_dict()
    bad["history"][0]["sample_rate"] = 2.0
    with pytest.raises(ConfigurationError, match="sample_rate"):
        accountant_from_state_dict(bad)


# -- adaptive clipping ----------------------------------------------------------------------


def test_adaptive_clipping_is_accounted_at_the_effective_sigma() -> None:
    sigma, sigma_b = 1.1, 8.0
    eff = accounting.effective_noise_multiplier(sigma, count_noise_multiplier=sigma_b)
    assert eff == pytest.approx((sigma**-2 + (2 * sigma_b) ** -2) ** -0.5)
    assert eff < sigma
    with_count = RDPAccountant()
    with_count.step(noise_multiplier=sigma, sample_rate=0.01, num_steps=500,
                    count_noise_multiplier=sigma_b)  # fmt: skip
    plain = RDPAccountant()
    plain.step(noise_multiplier=eff, sample_rate=0.01, num_steps=500)
    assert with_count.get_epsilon(1e-5) == pytest.approx(plain.get_epsilon(1e-5), rel=1e-12)
    assert with_count.history[0].effective_noise_multiplier == pytest.approx(eff)
    assert with_count.get_epsilon(1e-5) > epsilon(
        sample_rate=0.01, noise_multiplier=sigma, steps=500, delta=1e-5, accountant="rdp"
    )


@settings(max_examples=30, deadline=None)
@given(sigma=st.floats(0.3, 20.0), ratio=st.floats(0.51, 100.0))
def test_gradient_noise_inverts_effective_noise(sigma: float, ratio: float) -> None:
    sigma_b = ratio * sigma
    grad = accounting.gradient_noise_multiplier(sigma, count_noise_multiplier=sigma_b)
    assert grad > sigma
    back = accounting.effective_noise_multiplier(grad, count_noise_multiplier=sigma_b)
    assert back == pytest.approx(sigma, rel=1e-9)


def test_gradient_noise_refuses_too_little_count_noise() -> None:
    with pytest.raises(ConfigurationError, match="count_noise_multiplier"):
        accounting.gradient_noise_multiplier(1.0, count_noise_multiplier=0.5)


def test_calibrate_with_count_noise() -> None:
    kw = {"delta": 1e-5, "sample_rate": 0.01, "steps": 1000, "accountant": "rdp"}
    plain = calibrate_noise(target_epsilon=2.0, **kw)  # type: ignore[arg-type]
    sigma = calibrate_noise(target_epsilon=2.0, count_noise_multiplier=5.0, **kw)  # type: ignore[arg-type]
    assert sigma > plain
    assert epsilon(sample_rate=0.01, noise_multiplier=sigma, steps=1000, delta=1e-5,
                   accountant="rdp", count_noise_multiplier=5.0) <= 2.0  # fmt: skip
    # The count alone (σ_eff → 2σ_b as σ → ∞) already costs more than the target.
    with pytest.raises(ConfigurationError, match="unreachable") as info:
        calibrate_noise(target_epsilon=0.5, count_noise_multiplier=0.3, **kw)  # type: ignore[arg-type]
    assert "gives ε=" in str(info.value)


# -- fixed-shape truncated Poisson ----------------------------------------------------------


def test_truncation_probability_matches_binomial_sum() -> None:
    n, q, b_max = 60, 0.1, 9
    # Reference: Σ_{k > B_max} C(N+1, k) q^k (1-q)^(N+1-k), with exact integers.
    ref = sum(math.comb(n + 1, k) * q**k * (1 - q) ** (n + 1 - k) for k in range(b_max + 1, n + 2))
    got = accounting.truncation_probability(dataset_size=n, sample_rate=q, max_batch_size=b_max)
    assert got == pytest.approx(ref, rel=1e-9)


def test_max_batch_size_for_is_minimal() -> None:
    n, q, steps, budget = 50_000, 0.002, 3000, 1e-9
    b = accounting.max_batch_size_for(
        dataset_size=n, sample_rate=q, steps=steps, truncation_budget=budget
    )

    def mass(b_max: int) -> float:
        p = accounting.truncation_probability(dataset_size=n, sample_rate=q, max_batch_size=b_max)
        return steps * p

    assert mass(b) <= budget < mass(b - 1)
    assert accounting.max_batch_size_for(dataset_size=n, sample_rate=q, steps=0) == 1
    with pytest.raises(ConfigurationError, match="truncation_budget"):
        accounting.max_batch_size_for(dataset_size=n, sample_rate=q, steps=1, truncation_budget=0)


@pytest.mark.parametrize("multiple", [1, 3, 8])
def test_fixed_shape_slots_rounds_the_minimal_slots_up(multiple: int) -> None:
    n, q, steps, delta, eps = 20_000, 0.005, 500, 1e-8, 8.0
    needed = accounting.max_batch_size_for(
        dataset_size=n,
        sample_rate=q,
        steps=steps,
        truncation_budget=accounting.truncation_budget_for(delta, eps),
    )
    got = accounting.fixed_shape_slots(
        dataset_size=n,
        sample_rate=q,
        steps=steps,
        delta=delta,
        target_epsilon=eps,
        multiple_of=multiple,
    )
    assert got % multiple == 0
    assert needed <= got < needed + multiple


def test_fixed_shape_slots_never_exceed_the_dataset_and_check_the_multiple() -> None:
    assert (
        accounting.fixed_shape_slots(
            dataset_size=10, sample_rate=0.9, steps=100, delta=1e-6, multiple_of=4
        )
        == 10
    )
    with pytest.raises(ConfigurationError, match="multiple_of"):
        accounting.fixed_shape_slots(
            dataset_size=10, sample_rate=0.5, steps=1, delta=1e-6, multiple_of=0
        )


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_truncated_poisson_adds_the_union_bound_to_delta(kind: str) -> None:
    n, q, sigma, steps, delta = 10_000, 0.01, 1.0, 1000, 1e-5
    opts = FAST if kind == "pld" else {}
    plain = make_accountant(kind, **opts)
    plain.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    b_max = 170
    trunc = make_accountant(kind, **opts)
    trunc.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps, max_batch_size=b_max,
               dataset_size=n)  # fmt: skip
    p = accounting.truncation_probability(dataset_size=n, sample_rate=q, max_batch_size=b_max)
    assert trunc.truncation_mass == pytest.approx(steps * p)
    assert 0 < steps * p < delta  # this B_max costs part of δ, not all of it
    for eps in (1.0, 2.0, 3.0):
        assert trunc.get_delta(eps) == pytest.approx(
            plain.get_delta(eps) + (1 + math.exp(eps)) * steps * p, rel=1e-12
        )
    eps = trunc.get_epsilon(delta)
    assert eps > plain.get_epsilon(delta)
    # Certified and minimal: δ(ε) meets the budget, a slightly smaller ε does not.
    assert trunc.get_delta(eps) <= delta
    assert trunc.get_delta(eps * (1 - 1e-4)) > delta
    # A generous B_max makes the correction negligible; a tight one makes every ε infeasible.
    loose = make_accountant(kind, **opts)
    loose.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps, max_batch_size=400,
               dataset_size=n)  # fmt: skip
    assert loose.get_epsilon(delta) == pytest.approx(plain.get_epsilon(delta), rel=1e-9)
    tight = make_accountant(kind, **opts)
    tight.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps, max_batch_size=120,
               dataset_size=n)  # fmt: skip
    assert tight.get_epsilon(delta) == math.inf
    assert tight.get_delta(1.0) == 1.0


def test_truncation_needs_both_sizes() -> None:
    acc = RDPAccountant()
    with pytest.raises(ConfigurationError, match="both"):
        acc.step(noise_multiplier=1.0, sample_rate=0.01, max_batch_size=100)
    with pytest.raises(ConfigurationError, match="both"):
        acc.step(noise_multiplier=1.0, sample_rate=0.01, dataset_size=100)
    with pytest.raises(ConfigurationError, match="max_batch_size"):
        acc.step(noise_multiplier=1.0, sample_rate=0.01, max_batch_size=0, dataset_size=100)


# -- calibration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "opts"), [("rdp", None), ("pld", FAST)], ids=["rdp", "pld-coarse"]
)
@pytest.mark.parametrize(("q", "steps", "target"), [(0.01, 1000, 2.0), (0.1, 200, 8.0)])
def test_calibration_round_trip(
    kind: str, opts: dict[str, float] | None, q: float, steps: int, target: float
) -> None:
    tol = 1e-3
    sigma = calibrate_noise(target_epsilon=target, delta=1e-5, sample_rate=q, steps=steps,
                            accountant=kind, tolerance=tol, accountant_options=opts)  # fmt: skip

    def eps(s: float) -> float:
        return epsilon(sample_rate=q, noise_multiplier=s, steps=steps, delta=1e-5,
                       accountant=kind, accountant_options=opts)  # fmt: skip

    assert eps(sigma) <= target
    assert eps(sigma / (1 + tol) ** 2) > target  # smallest, to the stated tolerance


def test_calibration_with_truncation_meets_target() -> None:
    kw = {"delta": 1e-5, "sample_rate": 0.01, "steps": 1000, "accountant": "rdp"}
    sigma = calibrate_noise(target_epsilon=2.0, max_batch_size=170, dataset_size=10_000, **kw)  # type: ignore[arg-type]
    assert epsilon(sample_rate=0.01, noise_multiplier=sigma, steps=1000, delta=1e-5,
                   accountant="rdp", max_batch_size=170, dataset_size=10_000) <= 2.0  # fmt: skip
    with pytest.raises(ConfigurationError, match="unreachable"):
        calibrate_noise(target_epsilon=2.0, max_batch_size=120, dataset_size=10_000, **kw)  # type: ignore[arg-type]


def test_calibration_unreachable_and_trivial_targets() -> None:
    with pytest.raises(ConfigurationError, match=r"unreachable.*even σ=1e\+06 gives ε="):
        calibrate_noise(target_epsilon=1e-4, delta=1e-5, sample_rate=1.0, steps=1000,
                        accountant="rdp")  # fmt: skip
    with pytest.raises(ConfigurationError, match="met by every"):
        calibrate_noise(target_epsilon=1e4, delta=1e-5, sample_rate=0.01, steps=10,
                        accountant="rdp")  # fmt: skip


# -- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize("q", [0.0, -0.1, 1.5, float("nan"), float("inf")])
def test_bad_sample_rate(q: float) -> None:
    with pytest.raises(ConfigurationError, match="sample_rate"):
        RDPAccountant().step(noise_multiplier=1.0, sample_rate=q)
    with pytest.raises(ConfigurationError, match="sample_rate"):
        epsilon(sample_rate=q, noise_multiplier=1.0, steps=10, delta=1e-5)


@pytest.mark.parametrize("sigma", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_noise_multiplier(sigma: float) -> None:
    with pytest.raises(ConfigurationError, match="noise_multiplier"):
        PLDAccountant().step(noise_multiplier=sigma, sample_rate=0.1)
    with pytest.raises(ConfigurationError, match="noise_multiplier"):
        epsilon(sample_rate=0.1, noise_multiplier=sigma, steps=10, delta=1e-5)


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 2.0, float("nan")])
def test_bad_delta(delta: float) -> None:
    acc = RDPAccountant()
    acc.step(noise_multiplier=1.0, sample_rate=0.1)
    with pytest.raises(ConfigurationError, match="delta"):
        acc.get_epsilon(delta)
    with pytest.raises(ConfigurationError, match="delta"):
        calibrate_noise(target_epsilon=1.0, delta=delta, sample_rate=0.1, steps=10)


def test_bad_steps_and_types() -> None:
    acc = RDPAccountant()
    with pytest.raises(ConfigurationError, match="num_steps"):
        acc.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=-1)
    with pytest.raises(InputTypeError, match="num_steps"):
        acc.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=1.5)  # type: ignore[arg-type]
    with pytest.raises(InputTypeError, match="num_steps"):
        acc.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=True)
    with pytest.raises(ConfigurationError, match="steps"):
        epsilon(sample_rate=0.1, noise_multiplier=1.0, steps=-5, delta=1e-5)
    with pytest.raises(InputTypeError, match="sample_rate"):
        acc.step(noise_multiplier=1.0, sample_rate="0.1")  # type: ignore[arg-type]
    with pytest.raises(InputTypeError, match="noise_multiplier"):
        acc.step(noise_multiplier=None, sample_rate=0.1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        acc.step(noise_multiplier=1.0, sample_rate=0.1, steps=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        epsilon(sample_rate=0.1, noise_multiplier=1.0, steps=5, delta=1e-5, eps=1)  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match="epsilon"):
        acc.get_delta(-1.0)
    assert acc.history == ()


def test_bad_accountant_options() -> None:
    with pytest.raises(ConfigurationError, match="accountant"):
        epsilon(sample_rate=0.1, noise_multiplier=1.0, steps=5, delta=1e-5, accountant="moments")
    with pytest.raises(InputTypeError, match="accountant_options"):
        epsilon(sample_rate=0.1, noise_multiplier=1.0, steps=5, delta=1e-5,
                accountant_options=[1e-3])  # type: ignore[arg-type]  # fmt: skip
    with pytest.raises(TypeError):
        make_accountant("pld", interval=1e-3)
    with pytest.raises(ConfigurationError, match="value_discretization_interval"):
        PLDAccountant(value_discretization_interval=0.0)
    with pytest.raises(InputTypeError, match="value_discretization_interval"):
        PLDAccountant(value_discretization_interval="1e-3")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="discretization"):
        PLDAccountant(discretization="nearest")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="orders"):
        RDPAccountant(orders=[0.5, 2.0])
    with pytest.raises(InputTypeError, match="orders"):
        RDPAccountant(orders=["a"])  # type: ignore[list-item]
    for bad_target in (0.0, -1.0, float("inf")):
        with pytest.raises(ConfigurationError, match="target_epsilon"):
            calibrate_noise(target_epsilon=bad_target, delta=1e-5, sample_rate=0.1, steps=10)
    with pytest.raises(ConfigurationError, match="tolerance"):
        calibrate_noise(target_epsilon=1.0, delta=1e-5, sample_rate=0.1, steps=10, tolerance=0.9)
    with pytest.raises(ConfigurationError, match="steps=0"):
        calibrate_noise(target_epsilon=1.0, delta=1e-5, sample_rate=0.1, steps=0)


def test_enormous_pld_is_refused_before_allocating() -> None:
    # σ = 0.05 without subsampling: each step's loss has sd 1/σ = 20 nats, so a million steps
    # spread over ~10⁵ nats: 10⁸ grid points at Δ = 1e-3.
    acc = PLDAccountant(value_discretization_interval=1e-3)
    acc.step(noise_multiplier=0.05, sample_rate=1.0, num_steps=1_000_000)
    with pytest.raises(ConfigurationError, match="grid points"):
        acc.get_epsilon(1e-5)


def test_default_orders_are_dp_accountings() -> None:
    assert tuple(DEFAULT_RDP_ORDERS) == tuple(float(a) for a in dpa_rdp.DEFAULT_RDP_ORDERS)
    assert accounting.DEFAULT_RDP_ORDERS is DEFAULT_RDP_ORDERS


@pytest.mark.parametrize(("sigma", "sigma_b"), [(1.0, 5.0), (0.7, 0.4), (3.0, 40.0)])
def test_adaptive_formula_agrees_with_the_clipping_side(sigma: float, sigma_b: float) -> None:
    # opake.dpsgd.clipping (training side) and opake.accounting (accounting side) implement
    # Andrew et al.'s split independently; a mismatch would silently mis-account.
    from opake.dpsgd.clipping import gradient_noise_multiplier as clipping_side

    ours = accounting.gradient_noise_multiplier(sigma, count_noise_multiplier=sigma_b)
    assert clipping_side(sigma, count_noise_multiplier=sigma_b) == pytest.approx(ours, rel=1e-12)
