"""Privacy loss distributions (PLD) of the Poisson-subsampled Gaussian mechanism.

A PLD is the distribution of the privacy loss ``L = log(P(x) / Q(x))`` for ``x ~ P``, where
(P, Q) is a dominating pair of the mechanism's output distributions on two neighbouring
datasets. Under add/remove-one adjacency with Poisson rate q and noise multiplier σ
(sensitivity 1) the worst case is one of two pairs (both are tracked, ε is their maximum):

* ``remove``: P = (1-q)·N(0, σ²) + q·N(1, σ²), Q = N(0, σ²);
  ``L(x) = log(1 - q + q·exp((2x - 1) / (2σ²)))``, increasing in x;
* ``add``: P = N(0, σ²), Q = (1-q)·N(0, σ²) + q·N(1, σ²);
  ``L(x) = -log(1 - q + q·exp((2x - 1) / (2σ²)))``, decreasing in x.

``δ(ε) = E_P[(1 - exp(ε - L))_+]`` (the hockey-stick divergence) is computed in closed form from
normal tails. The continuous PLD is discretised on the grid ``{i·Δ}`` *pessimistically* — the
discrete PLD's δ(ε) is an upper bound of the true one for every ε — in one of two ways:

* ``"connect_dots"`` (default; Doroshenko, Ghazi, Kamath, Kumar, Manurangsi 2022, Algorithm 1):
  masses chosen so that the discrete δ equals the true δ at every grid point and interpolates
  it linearly in ``exp(ε)`` in between, which lies above the true δ because δ is convex in
  ``exp(ε)``. Its error does not grow linearly with the number of compositions;
* ``"round_up"`` (privacy buckets, Meiser & Mohammadi 2018): each loss rounded up to the next
  grid point. Simple and pessimistic, but the bias adds up: k steps can shift ε by up to k·Δ.

The mass beyond ``exp(-50)`` in the noise tails goes to the loss +∞ (pessimistic).
Compositions are convolutions: k-fold self-composition by one FFT over a window chosen from a
Chernoff bound (``tail_mass_truncation``, whose mass is added to +∞), different mechanisms by
``scipy.signal.fftconvolve`` with the lower tail moved up and the upper tail moved to +∞.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from opake.core.errors import ConfigurationError

__all__ = [
    "DiscretePLD",
    "Discretization",
    "compose_all",
    "subsampled_gaussian_delta",
    "subsampled_gaussian_pld",
]

Discretization = Literal["connect_dots", "round_up"]
Direction = Literal["remove", "add"]

_LOG_MASS_TRUNCATION = -50.0
_MAX_POINTS = 2**24  # 16 M float64 = 128 MiB per array (~1 GiB peak): refuse beyond that
_CHERNOFF_T = np.geomspace(1e-2, 1e2, 25)


@dataclass(frozen=True)
class DiscretePLD:
    """A PLD on the grid ``(lower + i)·interval`` plus a mass at +∞ (pessimistic estimate).

    Example:
        >>> pld = subsampled_gaussian_pld(1.0, 1.0, 1e-3, "remove")
        >>> round(pld.epsilon_for_delta(1e-5), 2)  # Gaussian mechanism, σ = 1
        4.38
    """

    interval: float
    lower: int
    probs: np.ndarray
    infinity_mass: float
    #: an estimate of how far floating-point rounding of the FFT compositions may move δ(ε):
    #: for each transform, the largest negative mass it produced (true masses are ≥ 0, so a
    #: negative one is rounding alone) times its number of points, summed along the
    #: compositions. Measured, not proven: :mod:`opake.accounting._floor` keeps ε(δ) from the
    #: PLD only for δ far above it.
    rounding: float = 0.0

    @classmethod
    def identity(cls, interval: float) -> DiscretePLD:
        """The PLD of a mechanism that reveals nothing (loss 0 with probability 1)."""
        return cls(interval, 0, np.ones(1), 0.0)

    @property
    def losses(self) -> np.ndarray:
        return (self.lower + np.arange(self.probs.size)) * self.interval

    def delta_for_epsilon(self, epsilon: float) -> float:
        """Hockey-stick divergence δ(ε) of this discrete PLD."""
        if math.isinf(epsilon) and epsilon > 0:
            return self.infinity_mass
        losses = self.losses
        above = losses > epsilon
        body = -np.dot(np.expm1(epsilon - losses[above]), self.probs[above])
        return float(min(1.0, self.infinity_mass + max(0.0, body)))

    def epsilon_for_delta(self, delta: float) -> float:
        """Smallest ε ≥ 0 with δ(ε) ≤ ``delta``; ``inf`` when the +∞ mass alone exceeds it."""
        if self.infinity_mass > delta:
            return math.inf
        losses = self.losses
        first = int(np.searchsorted(losses, 0.0, side="right"))  # first loss > 0
        p = self.probs[first:]
        if p.size == 0:
            return 0.0
        # U[i] = mass at losses ≥ l_i (+∞ included); R[i] = Σ_{m≥i} p_m·exp(l_i - l_m),
        # via the stable recurrence R[i] = p_i + exp(-Δ)·R[i+1].
        upper = self.infinity_mass + np.cumsum(p[::-1])[::-1]
        from scipy import signal

        ratio = signal.lfilter([1.0], [1.0, -math.exp(-self.interval)], p[::-1])[::-1]
        l0 = losses[first]
        delta_at_zero = upper[0] - math.exp(-l0) * ratio[0]
        if delta_at_zero <= delta:
            return 0.0
        # δ at each grid loss l_i counts only the strictly larger losses.
        upper_next = np.append(upper[1:], self.infinity_mass)
        ratio_next = np.append(ratio[1:], 0.0)
        delta_at = upper_next - math.exp(-self.interval) * ratio_next
        hit = int(np.flatnonzero(delta_at <= delta)[0])
        # On [l_{hit-1}, l_hit] (or [0, l_0]): δ(ε) = U[hit] - exp(ε - l_hit)·R[hit].
        l_hit = losses[first + hit]
        eps = l_hit + math.log((upper[hit] - delta) / ratio[hit])
        low = 0.0 if hit == 0 else float(losses[first + hit - 1])
        return float(min(max(eps, low), l_hit))

    def compose(self, other: DiscretePLD, tail_mass_truncation: float = 1e-15) -> DiscretePLD:
        """PLD of running both mechanisms (convolution), tails truncated pessimistically."""
        if not math.isclose(self.interval, other.interval, rel_tol=1e-12):
            raise ConfigurationError(
                f"cannot compose PLDs with intervals {self.interval} and {other.interval}"
            )
        _check_size(self.probs.size + other.probs.size, self.interval)
        from scipy import signal

        raw = signal.fftconvolve(self.probs, other.probs)
        rounding = self.rounding + other.rounding + _negative_mass(raw, raw.size)
        probs = np.clip(raw, 0.0, None)
        infinity = 1.0 - (1.0 - self.infinity_mass) * (1.0 - other.infinity_mass)
        offset, probs, right = _truncate_tails(probs, tail_mass_truncation)
        return DiscretePLD(
            self.interval,
            self.lower + other.lower + offset,
            probs,
            min(1.0, infinity + right),
            rounding,
        )

    def self_compose(self, times: int, tail_mass_truncation: float = 1e-15) -> DiscretePLD:
        """PLD of ``times`` runs of this mechanism, by one FFT over a Chernoff window."""
        if times == 1:
            return self
        if times < 1:
            raise ConfigurationError(f"times={times}: expected ≥ 1")
        lo, hi = _chernoff_window(self.probs, times, tail_mass_truncation, self.interval)
        out_len = hi - lo + 1
        _check_size(out_len, self.interval)
        from scipy import fft as sp_fft

        size = sp_fft.next_fast_len(max(out_len, self.probs.size), real=True)
        spectrum = sp_fft.rfft(self.probs, size) ** times
        circular = sp_fft.irfft(spectrum, size)
        window = np.clip(np.roll(circular, -lo)[:out_len], 0.0, None)
        # Mass beyond the window (≤ tail_mass_truncation by the Chernoff bound) aliases into
        # it; counting that much extra at +∞ keeps the estimate pessimistic.
        infinity = -math.expm1(times * math.log1p(-self.infinity_mass)) + tail_mass_truncation
        # an error of the input's masses moves the k-fold convolution's by at most k times it
        rounding = times * self.rounding + _negative_mass(circular, out_len)
        return DiscretePLD(
            self.interval, self.lower * times + lo, window, min(1.0, infinity), rounding
        )


def _negative_mass(raw: np.ndarray, points: int) -> float:
    """``points`` × the largest negative value of a transform's output (0 when none)."""
    return float(points * max(0.0, -float(raw.min()))) if raw.size else 0.0


def _check_size(points: int, interval: float) -> None:
    if points > _MAX_POINTS:
        raise ConfigurationError(
            f"this privacy loss distribution needs {points} grid points at interval {interval} "
            f"(the loss spans about {points * interval:.0f} nats: an enormous ε); use a larger "
            "value_discretization_interval, more noise, or the RDP accountant"
        )


def _truncate_tails(probs: np.ndarray, tail: float) -> tuple[int, np.ndarray, float]:
    """Drop ≤ tail/2 of mass on each side: left mass moves up to the first kept point."""
    if tail <= 0.0 or probs.size <= 1:
        return 0, probs, 0.0
    left_cum = np.cumsum(probs)
    right_cum = np.cumsum(probs[::-1])
    left = int(np.searchsorted(left_cum, tail / 2.0, side="right"))
    right = probs.size - int(np.searchsorted(right_cum, tail / 2.0, side="right"))
    right = max(right, left + 1)
    left_mass = float(probs[:left].sum())
    right_mass = float(probs[right:].sum())
    kept = probs[left:right].copy()
    kept[0] += left_mass
    return left, kept, right_mass


def _chernoff_window(
    probs: np.ndarray, times: int, tail: float, interval: float
) -> tuple[int, int]:
    """Index window (relative to ``times·lower``) outside which the k-fold sum has ≤ tail mass."""
    from scipy import special

    n = probs.size
    lo, hi = 0, (n - 1) * times
    if tail <= 0.0:
        return lo, hi
    idx = np.arange(n, dtype=np.float64)
    positive = probs > 0
    idx, weights = idx[positive], probs[positive]
    log_slack = math.log(2.0 / tail)
    for t_loss in _CHERNOFF_T:
        for t in (t_loss * interval, -t_loss * interval):
            log_mgf = float(special.logsumexp(idx * t, b=weights))
            bound = (times * log_mgf + log_slack) / t
            if not math.isfinite(bound):
                continue
            if t > 0:
                hi = min(hi, math.ceil(bound))
            else:
                lo = max(lo, math.floor(bound))
    if hi < lo:  # numerically degenerate: keep the full support
        return 0, (n - 1) * times
    return lo, hi


# -- the subsampled Gaussian ---------------------------------------------------------------


def _loss(x: np.ndarray, sigma: float, q: float, direction: Direction) -> np.ndarray:
    z = (2.0 * x - 1.0) / (2.0 * sigma**2)
    value = z if q == 1.0 else np.logaddexp(math.log1p(-q), math.log(q) + z)
    return value if direction == "remove" else -value


def _inverse_z(loss: np.ndarray, q: float, direction: Direction) -> np.ndarray:
    """z = (2x* - 1) / (2σ²) where x* = L⁻¹(loss), on the loss's range.

    remove: e^z = (e^ε - (1-q)) / q;   add: e^z = (e^-ε - (1-q)) / q.
    """
    e = loss if direction == "remove" else -loss
    if q == 1.0:
        return e
    return np.asarray(e + np.log(-np.expm1(math.log1p(-q) - e)) - math.log(q))


def subsampled_gaussian_delta(
    epsilons: np.ndarray | Iterable[float],
    noise_multiplier: float,
    sample_rate: float,
    direction: Direction,
) -> np.ndarray:
    """Exact δ(ε) of one Poisson-subsampled Gaussian step in one direction (vectorised).

    Example:
        >>> round(float(subsampled_gaussian_delta([0.0], 1.0, 1.0, "remove")[0]), 6)  # 2Φ(½)-1
        0.382925
    """
    from scipy import special

    eps = np.atleast_1d(np.asarray(epsilons, dtype=np.float64))
    sigma, q = float(noise_multiplier), float(sample_rate)
    log_q = math.log(q)
    log_1mq = math.log1p(-q) if q < 1.0 else -math.inf
    out = np.zeros_like(eps)
    if direction == "remove":
        # δ = q·[Φ̄((x*-1)/σ) - exp((2x*-1)/(2σ²))·Φ̄(x*/σ)],  x* = L⁻¹(ε)
        inside = eps > log_1mq
        out[~inside] = -np.expm1(eps[~inside])
        e = eps[inside]
        z = _inverse_z(e, q, direction)
        x = sigma**2 * z + 0.5
        log_s1 = special.log_ndtr(-(x - 1.0) / sigma)
        log_s0 = special.log_ndtr(-x / sigma)
        gap = log_s0 + z - log_s1
        out[inside] = np.exp(log_q + log_s1) * -np.expm1(np.minimum(gap, 0.0))
    else:
        # L > ε  ⇔  x < x*,  (2x*-1)/(2σ²) = log(e^-ε - (1-q)) - log q
        # δ = e^ε·q·[Φ(x*/σ)·exp((2x*-1)/(2σ²)) - Φ((x*-1)/σ)]
        inside = eps < -log_1mq
        e = eps[inside]
        z = _inverse_z(e, q, direction)
        x = sigma**2 * z + 0.5
        log_c0 = special.log_ndtr(x / sigma)
        log_c1 = special.log_ndtr((x - 1.0) / sigma)
        gap = log_c1 - log_c0 - z
        out[inside] = np.exp(e + log_q + log_c0 + z) * -np.expm1(np.minimum(gap, 0.0))
    return np.clip(out, 0.0, 1.0)


def _loss_survival(losses: np.ndarray, sigma: float, q: float, direction: Direction) -> np.ndarray:
    """P_upper(L > l) for grid losses l (the survival function of the continuous PLD)."""
    from scipy import special

    log_1mq = math.log1p(-q) if q < 1.0 else -math.inf
    out = np.zeros_like(losses)
    if direction == "remove":
        inside = losses > log_1mq
        out[~inside] = 1.0
        z = _inverse_z(losses[inside], q, direction)
        x = sigma**2 * z + 0.5
        out[inside] = (1.0 - q) * special.ndtr(-x / sigma) + q * special.ndtr(-(x - 1.0) / sigma)
    else:
        inside = losses < -log_1mq
        z = _inverse_z(losses[inside], q, direction)
        x = sigma**2 * z + 0.5
        out[inside] = special.ndtr(x / sigma)
    return out


def subsampled_gaussian_pld(
    noise_multiplier: float,
    sample_rate: float,
    interval: float,
    direction: Direction,
    discretization: Discretization = "connect_dots",
) -> DiscretePLD:
    """Pessimistic discrete PLD of one Poisson-subsampled Gaussian step (one direction)."""
    from scipy import special

    sigma, q = float(noise_multiplier), float(sample_rate)
    z_tail = float(special.ndtri(0.5 * math.exp(_LOG_MASS_TRUNCATION)))  # ≈ -10.2
    x_low, x_high = sigma * z_tail, -sigma * z_tail + 1.0
    ends = _loss(np.array([x_low, x_high]), sigma, q, direction)
    eps_low, eps_high = float(ends.min()), float(ends.max())
    i_low = math.floor(eps_low / interval)
    i_high = math.ceil(eps_high / interval)
    _check_size(i_high - i_low + 1, interval)
    grid = np.arange(i_low, i_high + 1, dtype=np.float64) * interval
    if discretization == "connect_dots":
        if i_high == i_low:
            d = subsampled_gaussian_delta(grid, sigma, q, direction)
            return DiscretePLD(interval, i_low, np.array([1.0 - d[0]]), float(d[0]))
        deltas = np.minimum.accumulate(subsampled_gaussian_delta(grid, sigma, q, direction))
        diffs = np.diff(deltas)
        probs = np.empty_like(deltas)
        e_d = math.exp(interval)
        em1 = math.expm1(interval)
        probs[0] = 1.0 - deltas[0] + diffs[0] / em1
        probs[1:-1] = (diffs[1:] - diffs[:-1] * e_d) / em1
        probs[-1] = diffs[-1] / math.expm1(-interval)
        return DiscretePLD(interval, i_low, np.maximum(probs, 0.0), float(deltas[-1]))
    if discretization == "round_up":
        survival = _loss_survival(grid, sigma, q, direction)
        probs = np.empty_like(survival)
        probs[0] = 1.0 - survival[0]  # everything at or below the first grid loss
        probs[1:] = np.maximum(survival[:-1] - survival[1:], 0.0)  # ((i-1)Δ, iΔ] → iΔ
        return DiscretePLD(interval, i_low, probs, float(survival[-1]))
    raise ConfigurationError(
        f"discretization={discretization!r}: expected 'connect_dots' or 'round_up'"
    )


def compose_all(plds: Iterable[DiscretePLD], interval: float) -> DiscretePLD:
    """Compose several PLDs (already self-composed per phase)."""
    result: DiscretePLD | None = None
    for pld in plds:
        result = pld if result is None else result.compose(pld)
    return DiscretePLD.identity(interval) if result is None else result
