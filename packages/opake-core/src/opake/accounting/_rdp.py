"""Rényi DP of the Poisson-subsampled Gaussian mechanism and its conversion to (ε, δ).

The RDP of the sampled Gaussian mechanism (SGM) at order α is ``log(A_α) / (α - 1)`` with
``A_α = E_{x~N(0,σ²)}[((1 - q) + q·exp((2x - 1) / (2σ²)))^α]`` (Mironov, Talwar, Zhang 2019,
"Rényi Differential Privacy of the Sampled Gaussian Mechanism"):

* integer α: the binomial expansion, exact (Sec. 3.2):
  ``A_α = Σ_{i=0..α} C(α, i) (1-q)^(α-i) q^i exp((i² - i) / (2σ²))``;
* fractional α: the two-sided series of Sec. 3.3 with erfc terms, summed in absolute value
  (an upper bound on A_α, as Google's ``dp-accounting`` does) until the terms fall 30 nats
  below the running total (at most 1000 terms; an order that does not converge is dropped).

The conversion to (ε, δ) uses the improved bound of Balle et al. 2020 ("Hypothesis testing
interpretations and Rényi DP", Prop. 12) / Canonne, Kamath, Steinke 2020 (eq. 20):
``ε = rdp + log1p(-1/α) - log(δ·α) / (α - 1)`` minimised over the orders, together with the
KL bound ``δ ≥ sqrt(1 - exp(-rdp))`` ⇒ ε = 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "DEFAULT_RDP_ORDERS",
    "delta_from_rdp",
    "epsilon_from_rdp",
    "subsampled_gaussian_rdp",
]

#: The order grid of ``dp-accounting``'s RdpAccountant: dense near 1, integers to 63, then a
#: few large orders for tiny δ.
DEFAULT_RDP_ORDERS: tuple[float, ...] = (
    *(1.0 + x / 10.0 for x in range(1, 100)),
    *(float(a) for a in range(11, 64)),
    128.0,
    256.0,
    512.0,
    1024.0,
)

_MAX_FRAC_TERMS = 1000
_FRAC_CHUNK = 100


def _log_comb(n: float, k: np.ndarray) -> np.ndarray:
    """log |C(n, k)| for real n and integer k ≥ 0 (gammaln gives log|Γ| off the poles)."""
    from scipy import special

    return np.asarray(
        special.gammaln(n + 1.0) - special.gammaln(k + 1.0) - special.gammaln(n - k + 1.0)
    )


def _log_erfc(x: np.ndarray) -> np.ndarray:
    from scipy import special

    return np.asarray(math.log(2.0) + special.log_ndtr(-x * math.sqrt(2.0)))


def _log_a_int(q: float, sigma: float, alpha: int) -> float:
    from scipy import special

    i = np.arange(alpha + 1, dtype=np.float64)
    terms = (
        _log_comb(float(alpha), i)
        + i * math.log(q)
        + (alpha - i) * math.log1p(-q)
        + (i * i - i) / (2.0 * sigma**2)
    )
    return float(special.logsumexp(terms))


def _log_a_frac(q: float, sigma: float, alpha: float) -> float:
    z0 = sigma**2 * math.log(1.0 / q - 1.0) + 0.5
    log_q, log_1mq = math.log(q), math.log1p(-q)
    scale = math.sqrt(2.0) * sigma
    total = -math.inf
    last_s0 = last_s1 = -math.inf
    for start in range(0, _MAX_FRAC_TERMS, _FRAC_CHUNK):
        i = np.arange(start, start + _FRAC_CHUNK, dtype=np.float64)
        j = alpha - i
        log_coef = _log_comb(alpha, i)
        log_s0 = (
            log_coef
            + i * log_q
            + j * log_1mq
            + (i * i - i) / (2.0 * sigma**2)
            + math.log(0.5)
            + _log_erfc((i - z0) / scale)
        )
        log_s1 = (
            log_coef
            + j * log_q
            + i * log_1mq
            + (j * j - j) / (2.0 * sigma**2)
            + math.log(0.5)
            + _log_erfc((z0 - j) / scale)
        )
        running = np.logaddexp.accumulate(np.concatenate([[total], np.logaddexp(log_s0, log_s1)]))
        totals = running[1:]
        prev0 = np.concatenate([[last_s0], log_s0[:-1]])
        prev1 = np.concatenate([[last_s1], log_s1[:-1]])
        done = (log_s0 < prev0) & (log_s1 < prev1) & (np.maximum(log_s0, log_s1) < totals - 30.0)
        hits = np.flatnonzero(done)
        if hits.size:
            return float(totals[hits[0]])
        total = float(totals[-1])
        last_s0, last_s1 = float(log_s0[-1]), float(log_s1[-1])
    return math.inf


def subsampled_gaussian_rdp(
    sample_rate: float, noise_multiplier: float, orders: Sequence[float]
) -> np.ndarray:
    """RDP ε(α) of one step of the Poisson-subsampled Gaussian mechanism, for each order.

    Example:
        >>> float(subsampled_gaussian_rdp(1.0, 2.0, [2.0])[0])  # q = 1: α / (2σ²)
        0.25
    """
    q, sigma = float(sample_rate), float(noise_multiplier)
    orders_arr = np.asarray(orders, dtype=np.float64)
    if q == 1.0:
        return orders_arr / (2.0 * sigma**2)
    out = np.empty_like(orders_arr)
    for n, alpha in enumerate(orders_arr):
        if float(alpha).is_integer():
            log_a = _log_a_int(q, sigma, int(alpha))
        else:
            log_a = _log_a_frac(q, sigma, float(alpha))
        out[n] = log_a / (alpha - 1.0)
    return out


def epsilon_from_rdp(
    orders: Sequence[float], rdp: Sequence[float] | np.ndarray, delta: float
) -> tuple[float, float]:
    """Smallest ε over the orders for this δ (improved conversion); returns ``(ε, order)``.

    Example:
        >>> eps, order = epsilon_from_rdp([2.0, 8.0, 32.0], [0.5, 2.0, 8.0], 1e-5)
        >>> round(eps, 4), order
        (3.2141, 8.0)
    """
    best, best_order = math.inf, float(orders[0])
    for alpha, r in zip(orders, rdp, strict=True):
        a, value = float(alpha), float(r)
        if not math.isfinite(value):
            continue
        if value <= 0.0 or delta**2 + math.expm1(-value) > 0.0:
            eps = 0.0  # KL bound: δ ≥ sqrt(1 - exp(-rdp)) already gives ε = 0
        elif a > 1.01:  # unstable as α → 1, and useless there anyway
            eps = value + math.log1p(-1.0 / a) - math.log(delta * a) / (a - 1.0)
        else:
            continue
        if eps < best:
            best, best_order = eps, a
    return max(0.0, best), best_order


def delta_from_rdp(
    orders: Sequence[float], rdp: Sequence[float] | np.ndarray, epsilon: float
) -> tuple[float, float]:
    """Smallest δ over the orders for this ε (improved conversion); returns ``(δ, order)``.

    Example:
        >>> delta, order = delta_from_rdp([2.0, 8.0, 32.0], [0.5, 2.0, 8.0], 3.2141)
        >>> f"{delta:.2e}", order
        ('1.00e-05', 8.0)
    """
    best, best_order = math.inf, float(orders[0])
    for alpha, r in zip(orders, rdp, strict=True):
        a, value = float(alpha), float(r)
        if math.isnan(value):
            continue
        if value <= 0.0:
            log_delta = -math.inf
        elif math.isinf(value):
            log_delta = 0.0
        else:
            log_delta = 0.5 * math.log1p(-math.exp(-value))
            if a > 1.01:
                bound = (a - 1.0) * (value - epsilon + math.log1p(-1.0 / a)) - math.log(a)
                log_delta = min(log_delta, bound)
        if log_delta < best:
            best, best_order = log_delta, a
    return min(1.0, math.exp(best)), best_order
