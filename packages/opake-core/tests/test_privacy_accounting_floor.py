"""The PLD accountant never reports an ε below the true one at small δ (its FFT rounding).

At q = 1, k steps of noise multiplier σ are one Gaussian mechanism of σ/√k, whose δ(ε) has a
closed form; evaluated with 60 digits (mpmath) it is the exact oracle. Before the floor the
PLD answered δ = 1e-14 after 20 000 steps at σ = 200 with the ε of δ = 2.2e-14 (ε 5.357
against the exact 5.431): its FFT rounding (≈ 5e-14 on δ) exceeded δ itself.
"""

from __future__ import annotations

import itertools
import math

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opake import accounting
from opake.accounting import PLDAccountant
from opake.accounting._floor import PLD_DELTA_FLOOR

mpmath.mp.dps = 60


def exact_delta(eps: float, sigma: float, steps: int) -> float:
    """δ(ε) of ``steps`` Gaussian mechanisms of noise multiplier σ (sensitivity 1), exactly."""
    s = mpmath.mpf(sigma) / mpmath.sqrt(steps)
    e = mpmath.mpf(eps)
    value = mpmath.ncdf(1 / (2 * s) - e * s) - mpmath.exp(e) * mpmath.ncdf(-1 / (2 * s) - e * s)
    return float(value)


def _reported(sigma: float, steps: int, delta: float) -> float:
    return accounting.epsilon(sample_rate=1.0, noise_multiplier=sigma, steps=steps, delta=delta)


@pytest.mark.parametrize("delta", [1e-12, 1e-13, 1e-14])
def test_the_reported_epsilon_holds_at_small_delta_after_many_steps(delta: float) -> None:
    eps = _reported(200.0, 20_000, delta)
    assert exact_delta(eps, 200.0, 20_000) <= delta


@settings(max_examples=12, deadline=None)
@given(
    sigma=st.floats(20.0, 300.0),
    steps=st.integers(100, 30_000),
    exponent=st.floats(6.0, 15.0),
)
def test_search_the_reported_epsilon_is_never_below_the_exact_one(
    sigma: float, steps: int, exponent: float
) -> None:
    delta = 10.0**-exponent
    eps = _reported(sigma, steps, delta)
    assert exact_delta(eps, sigma, steps) <= delta * (1 + 1e-9)


def _accountant(sigma: float = 1.0, q: float = 0.01, steps: int = 1000) -> PLDAccountant:
    acc = PLDAccountant(value_discretization_interval=1e-3)
    acc.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    return acc


def test_above_the_floor_the_pld_answers_itself() -> None:
    acc = _accountant()
    assert acc.delta_floor() >= PLD_DELTA_FLOOR
    own = max(pld.epsilon_for_delta(1e-5) for pld in acc._plds())
    assert acc.get_epsilon(1e-5) == own


def test_epsilon_is_monotone_across_the_floor_and_get_delta_agrees() -> None:
    acc = _accountant()
    deltas = np.logspace(-6, -15, 28)
    eps = [acc.get_epsilon(float(d)) for d in deltas]
    assert all(b >= a for a, b in itertools.pairwise(eps))
    floor = acc.delta_floor()
    for d, e in zip(deltas, eps, strict=True):
        # RDP's two conversions (ε of δ, δ of ε) are each an upper bound, inverse to 1e-7
        assert acc.get_delta(e) <= d * (1 + (1e-9 if d >= floor else 1e-6))
        if d < floor:  # the RDP bound of the same steps, never below the PLD at the floor
            rdp = accounting.epsilon(
                sample_rate=0.01, noise_multiplier=1.0, steps=1000, delta=float(d), accountant="rdp"
            )
            assert e == pytest.approx(max(rdp, acc.get_epsilon(floor)), rel=1e-12)


def test_the_floor_grows_with_the_compositions_rounding() -> None:
    acc = _accountant(sigma=0.6, q=0.01, steps=100_000)
    rounding = max(pld.rounding for pld in acc._plds())
    assert rounding > 0.0  # the transforms produced negative masses: their rounding is visible
    assert acc.delta_floor() == max(PLD_DELTA_FLOOR, 100.0 * rounding)


def test_truncated_sampling_below_the_floor_is_certified() -> None:
    acc = PLDAccountant(value_discretization_interval=1e-3)
    acc.step(
        noise_multiplier=1.0,
        sample_rate=0.01,
        num_steps=500,
        max_batch_size=90,
        dataset_size=2000,
    )
    eps = acc.get_epsilon(1e-12)
    assert math.isfinite(eps)
    assert acc.get_delta(eps) <= 1e-12
