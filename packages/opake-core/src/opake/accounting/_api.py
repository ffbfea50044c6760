"""The two plain functions of the common case: ε for a schedule, σ for a target ε."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from opake.accounting._accountant import PrivacyAccountant, make_accountant
from opake.accounting._validate import (
    check_delta,
    check_epsilon,
    check_noise_multiplier,
    check_sample_rate,
    check_steps,
)
from opake.core.choices import TRAINING_PLD_OPTIONS
from opake.core.errors import ConfigurationError, InputTypeError

__all__ = ["CALIBRATION_RANGE", "TRAINING_PLD_OPTIONS", "calibrate_noise", "epsilon"]

#: The noise multipliers :func:`calibrate_noise` searches.
CALIBRATION_RANGE: tuple[float, float] = (0.1, 1.0e6)


def _accountant(kind: str, options: Mapping[str, Any] | None) -> PrivacyAccountant:
    if options is not None and not isinstance(options, Mapping):
        raise InputTypeError(
            f"accountant_options={options!r}: expected a mapping such as "
            "{'value_discretization_interval': 1e-3}"
        )
    return make_accountant(kind, **dict(options or {}))


def epsilon(
    *,
    sample_rate: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    accountant: str = "pld",
    count_noise_multiplier: float | None = None,
    max_batch_size: int | None = None,
    dataset_size: int | None = None,
    accountant_options: Mapping[str, Any] | None = None,
) -> float:
    """ε spent by ``steps`` DP-SGD steps with Poisson rate q and noise σ, at this δ.

    Args:
        sample_rate: Poisson rate q (expected batch size / dataset size).
        noise_multiplier: σ (noise std / clipping bound).
        steps: number of steps.
        delta: δ of the (ε, δ) guarantee.
        accountant: ``"pld"`` (tight, default) or ``"rdp"`` (fast, looser).
        count_noise_multiplier: σ_b of adaptive clipping's noisy count, if any.
        max_batch_size: ``B_max`` of fixed-shape truncated Poisson sampling (with
            ``dataset_size``): the truncation probability is added to δ.
        dataset_size: N, with ``max_batch_size``.
        accountant_options: options of the accountant, e.g.
            ``{"value_discretization_interval": 1e-3}``.

    Example:
        >>> round(epsilon(sample_rate=0.01, noise_multiplier=1.0, steps=1000, delta=1e-5,
        ...               accountant="rdp"), 3)
        2.101
    """
    acc = _accountant(accountant, accountant_options)
    acc.step(
        noise_multiplier=noise_multiplier,
        sample_rate=sample_rate,
        num_steps=check_steps(steps, "steps"),
        count_noise_multiplier=count_noise_multiplier,
        max_batch_size=max_batch_size,
        dataset_size=dataset_size,
    )
    return acc.get_epsilon(check_delta(delta))


def calibrate_noise(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "pld",
    tolerance: float = 1e-3,
    count_noise_multiplier: float | None = None,
    max_batch_size: int | None = None,
    dataset_size: int | None = None,
    accountant_options: Mapping[str, Any] | None = None,
) -> float:
    """The smallest noise multiplier σ whose ε(δ) is at most ``target_epsilon``.

    Bisection on log σ keeps ``ε(σ_hi) ≤ target < ε(σ_lo)`` and stops when
    ``σ_hi / σ_lo - 1 ≤ tolerance``; ``σ_hi`` is returned, so the result is verified to meet
    the target and is within a factor ``1 + tolerance`` of the smallest σ that does (for the
    chosen accountant). With ``count_noise_multiplier`` the result is the *gradient* noise
    multiplier to use alongside that count noise.

    Raises:
        ConfigurationError: invalid input, or a target no σ in :data:`CALIBRATION_RANGE`
            reaches (the message gives the best ε achievable), or one every σ in it meets.

    Example:
        >>> sigma = calibrate_noise(target_epsilon=2.0, delta=1e-5, sample_rate=0.01,
        ...                         steps=1000, accountant="rdp")
        >>> round(sigma, 2)
        1.02
    """
    target, delta, q, n_steps = _calibration_inputs(
        target_epsilon, delta, sample_rate, steps, tolerance=tolerance, count=count_noise_multiplier
    )
    _accountant(accountant, accountant_options)  # fail early on a bad name or options

    def eps_at(sigma: float) -> float:
        return epsilon(
            sample_rate=q,
            noise_multiplier=sigma,
            steps=n_steps,
            delta=delta,
            accountant=accountant,
            count_noise_multiplier=count_noise_multiplier,
            max_batch_size=max_batch_size,
            dataset_size=dataset_size,
            accountant_options=accountant_options,
        )

    start = 1.0
    if accountant != "rdp" and count_noise_multiplier is None and max_batch_size is None:
        # RDP is cheap and (almost always) looser: its σ is a good upper starting point.
        try:
            start = calibrate_noise(
                target_epsilon=target,
                delta=delta,
                sample_rate=q,
                steps=n_steps,
                accountant="rdp",
                tolerance=0.01,
            )
        except ConfigurationError:
            start = 1.0
    lo, hi = _bracket(
        eps_at,
        start,
        target=target,
        delta=delta,
        setting=f"q={q}, steps={n_steps}",
        count_noise=bool(count_noise_multiplier),
        truncated=max_batch_size is not None,
    )
    while hi / lo - 1.0 > tolerance:
        mid = math.sqrt(lo * hi)
        if eps_at(mid) <= target:
            hi = mid
        else:
            lo = mid
    return hi


def _calibration_inputs(
    target_epsilon: object,
    delta: object,
    sample_rate: object,
    steps: object,
    *,
    tolerance: object,
    count: float | None,
) -> tuple[float, float, float, int]:
    """Check :func:`calibrate_noise`'s inputs; returns the target, δ, q and the step count."""
    target = check_epsilon(target_epsilon, "target_epsilon", positive=True)
    checked_delta = check_delta(delta)
    q = check_sample_rate(sample_rate)
    n_steps = check_steps(steps, "steps")
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float):
        raise InputTypeError(f"tolerance={tolerance!r}: expected a float")
    if not 1e-9 <= float(tolerance) <= 0.5:
        raise ConfigurationError(
            f"tolerance={tolerance!r}: expected a relative tolerance on σ in [1e-9, 0.5]"
        )
    if count is not None:
        check_noise_multiplier(count, "count_noise_multiplier")
    if n_steps == 0:
        raise ConfigurationError(
            "steps=0: no step spends privacy, so there is no noise multiplier to calibrate"
        )
    return target, checked_delta, q, n_steps


def _bracket(
    eps_at: Callable[[float], float],
    start: float,
    *,
    target: float,
    delta: float,
    setting: str,
    count_noise: bool,
    truncated: bool,
) -> tuple[float, float]:
    """σ_lo < σ_hi in :data:`CALIBRATION_RANGE` with ``ε(σ_hi) ≤ target < ε(σ_lo)``.

    Steps geometrically from ``start`` (by 1.25 from an RDP estimate, by 2 from 1.0); raises
    when the target is unreachable, or met by every σ of the range.
    """
    low_limit, high_limit = CALIBRATION_RANGE
    factor = 2.0 if start == 1.0 else 1.25
    hi = min(max(start, low_limit), high_limit)
    lo: float | None = None
    eps_hi = eps_at(hi)
    while eps_hi > target:
        lo = hi
        if hi >= high_limit:
            raise ConfigurationError(
                f"target_epsilon={target} at δ={delta} is unreachable: even σ={high_limit:g} "
                f"gives ε={eps_hi:.6g} ({setting}"
                + (", with adaptive clipping's count noise" if count_noise else "")
                + (", with fixed-shape truncation" if truncated else "")
                + "); raise δ or the target"
                + (", or lower the count noise's cost" if count_noise else "")
                + (", or raise max_batch_size" if truncated else "")
            )
        hi = min(hi * factor, high_limit)
        eps_hi = eps_at(hi)
    while lo is None:
        candidate = hi / factor
        if candidate < low_limit:
            raise ConfigurationError(
                f"target_epsilon={target} at δ={delta} is met by every σ ≥ {low_limit} "
                f"(ε={eps_at(low_limit):.6g} at σ={low_limit}); such loose targets are outside "
                "the calibrated range: pick σ yourself or ask for a smaller ε"
            )
        if eps_at(candidate) > target:
            lo = candidate
        else:
            hi = candidate
    return lo, hi
