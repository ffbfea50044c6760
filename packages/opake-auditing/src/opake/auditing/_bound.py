"""The one-run bound: correct guesses about m canaries → a lower bound on ε.

Steinke, Nasr & Jagielski ("Privacy auditing with one (1) training run", NeurIPS 2023,
Theorem 3): let each of m canaries be included independently with probability ½, let an
(ε, δ)-DP mechanism train on the included ones, and let an auditor make r guesses ("in" or
"out", abstaining on the rest) from its output. With ``f(v) = P[Binomial(r, q) ≥ v]``,
``q = e^ε / (1 + e^ε)``, the number W of correct guesses satisfies

    P[W ≥ v] ≤ f(v) + 2·m·δ · max_{1 ≤ i ≤ v} (f(v − i) − f(v)) / i.

The right-hand side is the p-value of "the mechanism is (ε, δ)-DP" after v correct guesses
(:func:`p_value`); :func:`epsilon_lower_bound` is the smallest ε at which that p-value rises
above β = 1 − confidence: every smaller ε is rejected at level β.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from opake.core.errors import ConfigurationError, InputTypeError

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import ArrayLike, NDArray

__all__ = ["EPSILON_CEILING", "NEGLIGIBLE", "epsilon_lower_bound", "p_value"]

#: the bound search stops here (e^ε overflows nothing, and no audit of m ≤ 10⁹ canaries gets
#: near it: r correct guesses at δ = 0 give at most ε = −ln(β^(−1/r) − 1) ≈ ln(r / ln(1/β)))
EPSILON_CEILING = 50.0
#: a lower bound below this shows nothing (≈ 0)
NEGLIGIBLE = 0.05
_GRID = 0.02  # spacing of the scan for the first ε whose p-value exceeds β
_CHUNK = 1 << 18  # at most this many p-value terms (grid points × correct guesses) at once
_TOL = 1e-6


def _count(name: str, value: object, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputTypeError(f"{name}={value!r} ({type(value).__name__}): expected an int")
    if value < minimum:
        raise ConfigurationError(f"{name}={value}: expected an int >= {minimum}")
    return value


def _check(canaries: object, guesses: object, correct: object) -> tuple[int, int, int]:
    m = _count("canaries", canaries, minimum=1)
    r = _count("guesses", guesses)
    v = _count("correct", correct)
    if not v <= r <= m:
        raise ConfigurationError(
            f"canaries={m}, guesses={r}, correct={v}: expected correct <= guesses <= canaries"
        )
    return m, r, v


def _probability(name: str, value: object, *, closed: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputTypeError(f"{name}={value!r} ({type(value).__name__}): expected a float")
    x = float(value)
    ok = (0.0 <= x < 1.0) if closed else (0.0 < x < 1.0)
    if not ok:
        interval = "[0, 1)" if closed else "(0, 1)"
        raise ConfigurationError(f"{name}={value!r}: expected a probability in {interval}")
    return x


def _p_values(m: int, r: int, v: int, epsilons: ArrayLike, delta: float) -> NDArray[np.float64]:
    """:func:`p_value` at each ε of the array ``epsilons`` (one vectorised evaluation)."""
    import numpy as np
    from scipy import stats
    from scipy.special import expit

    q = expit(np.asarray(epsilons, dtype=np.float64))
    tail = stats.binom.sf(v - 1, r, q)  # f(v) = P[W >= v]
    if delta == 0.0 or v == 0:
        bare: NDArray[np.float64] = np.minimum(1.0, tail)  # scipy is untyped
        return bare
    # f(v - i) - f(v) = P[v - i <= W < v] = Σ_{j=1..i} pmf(v - j): a running sum over i
    pmf = stats.binom.pmf(np.arange(v - 1, -1, -1)[:, None], r, q[None, :])
    steps = np.cumsum(pmf, axis=0) / np.arange(1, v + 1)[:, None]
    bounded: NDArray[np.float64] = np.minimum(1.0, tail + 2.0 * m * delta * steps.max(axis=0))
    return bounded


def _p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    return float(_p_values(m, r, v, [epsilon], delta)[0])


def p_value(
    *, canaries: int, guesses: int, correct: int, epsilon: float, delta: float = 0.0
) -> float:
    """P[≥ ``correct`` right out of ``guesses``] if the mechanism were (ε, δ)-DP (Theorem 3).

    Args:
        canaries: m, the number of canaries (each included with probability ½).
        guesses: r, the number of canaries guessed "in" or "out" (the others abstained).
        correct: v, how many of the guesses were right.
        epsilon: ε ≥ 0 of the hypothesis.
        delta: δ of the hypothesis.

    Example:
        >>> p_value(canaries=100, guesses=100, correct=100, epsilon=0.0) == 0.5**100
        True
        >>> p_value(canaries=10, guesses=1, correct=1, epsilon=0.0)  # a coin flip
        0.5
        >>> round(p_value(canaries=10, guesses=1, correct=1, epsilon=0.0, delta=0.01), 4)  # + 2mδ·½
        0.6
    """
    m, r, v = _check(canaries, guesses, correct)
    if isinstance(epsilon, bool) or not isinstance(epsilon, int | float) or not epsilon >= 0:
        raise ConfigurationError(f"epsilon={epsilon!r}: expected a number >= 0")
    d = _probability("delta", delta, closed=True)
    return _p_value(m, r, v, float(epsilon), d)


def epsilon_lower_bound(
    *,
    canaries: int,
    guesses: int,
    correct: int,
    delta: float,
    confidence: float = 0.95,
) -> float:
    """The ε below which (ε, δ)-DP is rejected at ``confidence`` (0.0 when nothing is).

    The result is the smallest ε ≥ 0 whose :func:`p_value` exceeds β = 1 − confidence (found
    by a scan of step 0.02 and bisection to 1e-6): for every smaller ε the observed guesses are
    less likely than β under (ε, δ)-DP. Reporting the *first* crossing keeps the bound valid
    even where the p-value is not monotone in ε: if the mechanism is (ε*, δ)-DP, the bound
    exceeds ε* with probability at most β.

    Args:
        canaries: m, the number of canaries.
        guesses: r, the number of guesses (not abstained).
        correct: v, the number of correct guesses.
        delta: δ of the privacy claim being audited.
        confidence: 1 − β.

    Example:
        >>> # 100 guesses, all right, δ = 0: ε ≥ −ln(0.05^(−1/100) − 1) = 3.493
        >>> round(epsilon_lower_bound(canaries=100, guesses=100, correct=100, delta=0.0), 3)
        3.493
        >>> epsilon_lower_bound(canaries=1000, guesses=100, correct=50, delta=1e-5)
        0.0
    """
    m, r, v = _check(canaries, guesses, correct)
    d = _probability("delta", delta, closed=True)
    beta = 1.0 - _probability("confidence", confidence, closed=False)
    if beta <= 0.0:
        raise ConfigurationError(f"confidence={confidence!r}: expected a value below 1")

    def rejected(eps: float) -> bool:
        return _p_value(m, r, v, eps, d) <= beta

    if not rejected(0.0):
        return 0.0
    # the first grid point that is not rejected brackets the first crossing; the grid is
    # evaluated a chunk at a time (one vectorised p-value per chunk)
    import numpy as np

    grid = np.arange(1, round(EPSILON_CEILING / _GRID) + 1) * _GRID
    most = max(1, _CHUNK // max(1, v))
    lo, hi, start, chunk = 0.0, math.inf, 0, 16
    while start < len(grid):
        chunk = min(chunk, most)
        points = grid[start : start + chunk]
        kept = np.flatnonzero(_p_values(m, r, v, points, d) > beta)
        if kept.size:
            first = start + int(kept[0])
            lo, hi = (float(grid[first - 1]) if first else 0.0), float(grid[first])
            break
        start, chunk = start + chunk, 2 * chunk  # doubling: at most twice the points needed
    if not math.isfinite(hi):
        return EPSILON_CEILING
    while hi - lo > _TOL:
        mid = 0.5 * (lo + hi)
        if rejected(mid):
            lo = mid
        else:
            hi = mid
    return lo if math.isfinite(lo) else 0.0
