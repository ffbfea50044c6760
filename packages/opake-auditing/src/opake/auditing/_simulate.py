"""The audit of an ideal Gaussian mechanism, simulated: what resolution m canaries buy."""

from __future__ import annotations

import functools
import math
import secrets

from opake.auditing._onerun import draw_inclusion, one_run_audit
from opake.auditing._result import AuditResult
from opake.core.errors import ConfigurationError

__all__ = ["gaussian_epsilon", "simulate_gaussian_audit"]


def gaussian_epsilon(mu: float, delta: float) -> float:
    """ε(δ) of the Gaussian mechanism with sensitivity/σ = ``mu`` (μ-GDP), exactly.

    δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Balle & Wang 2018), inverted by bisection.

    Example:
        >>> round(gaussian_epsilon(1.0, 1e-5), 3)  # σ = 1: as opake.accounting for one step
        4.377
    """
    if not (mu > 0 and math.isfinite(mu)):
        raise ConfigurationError(f"mu={mu!r}: expected a finite number > 0")

    def cdf(x: float) -> float:
        return 0.5 * math.erfc(-x / math.sqrt(2.0))

    def delta_of(eps: float) -> float:
        return cdf(-eps / mu + mu / 2) - math.exp(eps) * cdf(-eps / mu - mu / 2)

    if delta_of(0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while delta_of(hi) > delta:
        lo, hi = hi, 2 * hi
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if delta_of(mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def simulate_gaussian_audit(
    epsilon: float,
    *,
    canaries: int = 1000,
    delta: float = 1e-5,
    confidence: float = 0.95,
    seed: int | None = None,
) -> AuditResult:
    """Audit the ideal Gaussian mechanism whose true ε at ``delta`` is ``epsilon``.

    Each canary's score is ``μ·[included] + N(0, 1)`` with μ chosen so that the mechanism is
    exactly (ε, δ)-DP per canary: the strongest signal an (ε, δ)-DP Gaussian mechanism can give
    an auditor. The result's lower bound is what one run with this many canaries can show at
    best for such a mechanism.

    Example:
        >>> result = simulate_gaussian_audit(8.0, canaries=1000, seed=0)
        >>> 0.0 < result.epsilon_lower_bound <= 8.0
        True
    """
    import numpy as np

    mu = _mu_for(epsilon, delta)
    master = secrets.randbits(63) if seed is None else seed
    included = draw_inclusion(canaries, seed=master)
    rng = np.random.default_rng(master + 1)
    scores = mu * included + rng.standard_normal(canaries)
    return one_run_audit(
        scores,
        included,
        claimed_epsilon=epsilon,
        delta=delta,
        confidence=confidence,
        kind="simulated-gaussian",
    )


@functools.lru_cache(maxsize=256)
def _mu_for(epsilon: float, delta: float) -> float:
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ConfigurationError(f"epsilon={epsilon!r}: expected a finite number > 0")
    lo, hi = 0.0, 1.0
    while gaussian_epsilon(hi, delta) < epsilon:
        lo, hi = hi, 2 * hi
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if gaussian_epsilon(mid, delta) < epsilon:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)
