"""The one-run bound against hand-derived values and a slow exact reference."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opake.auditing import epsilon_lower_bound, p_value
from opake.core.errors import ConfigurationError, InputTypeError


def reference_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """Theorem 3 term by term, in exact rationals where the inputs allow."""
    q = Fraction(1) / (1 + Fraction(math.exp(-eps)))

    def tail(k: int) -> Fraction:  # P[Binomial(r, q) >= k]
        k = max(k, 0)
        return sum(
            (math.comb(r, j) * q**j * (1 - q) ** (r - j) for j in range(k, r + 1)), Fraction(0)
        )

    f_v = tail(v)
    worst = max((((tail(v - i) - f_v) / i) for i in range(1, v + 1)), default=Fraction(0))
    return float(min(Fraction(1), f_v + 2 * m * Fraction(delta) * worst))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 30).flatmap(
        lambda m: st.tuples(st.just(m), st.integers(0, m)).flatmap(
            lambda mr: st.tuples(st.just(mr[0]), st.just(mr[1]), st.integers(0, mr[1]))
        )
    ),
    st.floats(0.0, 6.0),
    st.sampled_from([0.0, 1e-6, 1e-3, 0.01]),
)
def test_p_value_matches_the_exact_reference(mrv, eps, delta):
    m, r, v = mrv
    got = p_value(canaries=m, guesses=r, correct=v, epsilon=eps, delta=delta)
    assert got == pytest.approx(reference_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("r", [10, 100, 1000])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_all_correct_without_delta_matches_the_closed_form(r, confidence):
    # P[W >= r] = q^r <= β  <=>  ε <= -ln(β^(-1/r) - 1)
    beta = 1 - confidence
    expected = -math.log(beta ** (-1 / r) - 1)
    got = epsilon_lower_bound(canaries=r, guesses=r, correct=r, delta=0.0, confidence=confidence)
    assert got == pytest.approx(expected, abs=2e-6)


@pytest.mark.parametrize(("m", "delta"), [(10, 1e-3), (100, 1e-4), (1000, 1e-5)])
def test_one_guess_with_delta_matches_the_closed_form(m, delta):
    # r = v = 1: p = q + 2mδ(1 - q) = β  <=>  q = (β - 2mδ) / (1 - 2mδ)
    beta = 0.05
    q = (beta - 2 * m * delta) / (1 - 2 * m * delta)
    # q < ½ here: even ε = 0 gives p = ½ + mδ > β, so nothing is rejected
    assert q < 0.5
    assert epsilon_lower_bound(canaries=m, guesses=1, correct=1, delta=delta) == 0.0
    # with confidence 0.4 (β = 0.6) one correct guess rejects ε below logit(q)
    beta = 0.6
    q = (beta - 2 * m * delta) / (1 - 2 * m * delta)
    got = epsilon_lower_bound(canaries=m, guesses=1, correct=1, delta=delta, confidence=0.4)
    assert got == pytest.approx(math.log(q / (1 - q)), abs=2e-6)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 400), st.floats(0.5, 1.0), st.sampled_from([0.0, 1e-6, 1e-4]))
def test_the_bound_is_the_first_crossing_of_beta(r, accuracy, delta):
    m = 2 * r
    v = round(accuracy * r)
    bound = epsilon_lower_bound(canaries=m, guesses=r, correct=v, delta=delta)
    beta = 0.05
    if bound == 0.0:
        assert p_value(canaries=m, guesses=r, correct=v, epsilon=0.0, delta=delta) > beta
        return
    # every ε below the bound is rejected (checked on a grid), the bound + 1e-5 is not
    for eps in [bound * k / 20 for k in range(20)]:
        assert p_value(canaries=m, guesses=r, correct=v, epsilon=eps, delta=delta) <= beta
    assert p_value(canaries=m, guesses=r, correct=v, epsilon=bound + 1e-5, delta=delta) > beta


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 300), st.data())
def test_more_correct_guesses_never_lower_the_bound(r, data):
    v = data.draw(st.integers(0, r - 1))
    low = epsilon_lower_bound(canaries=r, guesses=r, correct=v, delta=1e-5)
    high = epsilon_lower_bound(canaries=r, guesses=r, correct=v + 1, delta=1e-5)
    assert high >= low - 1e-6


def test_a_larger_delta_never_raises_the_bound():
    bounds = [
        epsilon_lower_bound(canaries=1000, guesses=200, correct=190, delta=d)
        for d in (0.0, 1e-7, 1e-5, 1e-4)
    ]
    assert bounds == sorted(bounds, reverse=True)
    assert bounds[0] > bounds[-1]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"canaries": 10, "guesses": 5, "correct": 6}, ConfigurationError),
        ({"canaries": 10, "guesses": 11, "correct": 1}, ConfigurationError),
        ({"canaries": 0, "guesses": 0, "correct": 0}, ConfigurationError),
        ({"canaries": 10.0, "guesses": 5, "correct": 5}, InputTypeError),
        ({"canaries": 10, "guesses": 5, "correct": 5, "delta": 1.0}, ConfigurationError),
        ({"canaries": 10, "guesses": 5, "correct": 5, "confidence": 1.0}, ConfigurationError),
        ({"canaries": 10, "guesses": 5, "correct": 5, "confidence": "high"}, InputTypeError),
    ],
)
def test_bad_input_raises_typed_errors(kwargs, error):
    kwargs.setdefault("delta", 0.0)
    with pytest.raises(error):
        epsilon_lower_bound(**kwargs)


def test_p_value_rejects_a_negative_epsilon():
    with pytest.raises(ConfigurationError, match="epsilon"):
        p_value(canaries=2, guesses=1, correct=1, epsilon=-1.0)


def test_the_scan_finds_the_first_crossing_of_a_plain_scan():
    """The vectorised scan against the obvious one: ε = 0, 0.02, 0.04, ... one p-value at a
    time until the first that exceeds β, then bisection."""
    from opake.auditing import p_value

    def plain(m, r, v, delta, beta=0.05):
        def rejected(eps):
            return p_value(canaries=m, guesses=r, correct=v, epsilon=eps, delta=delta) <= beta

        if not rejected(0.0):
            return 0.0
        k = 1
        while rejected(0.02 * k):
            k += 1
        lo, hi = 0.02 * (k - 1), 0.02 * k
        while hi - lo > 1e-6:
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if rejected(mid) else (lo, mid)
        return lo

    for m, r, v, delta in [(1000, 200, 170, 1e-5), (1000, 1000, 1000, 1e-8), (500, 60, 52, 0.0),
                           (2000, 800, 640, 1e-6), (100, 100, 97, 1e-3)]:  # fmt: skip
        ours = epsilon_lower_bound(canaries=m, guesses=r, correct=v, delta=delta)
        assert ours == pytest.approx(plain(m, r, v, delta), abs=2e-6)
        assert ours > 0.5
