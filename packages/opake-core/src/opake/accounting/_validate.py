"""Argument checks shared by the accountants: typed errors that say what to do."""

from __future__ import annotations

import math
import numbers

from opake.core.errors import ConfigurationError, InputTypeError

__all__ = [
    "check_delta",
    "check_epsilon",
    "check_noise_multiplier",
    "check_positive_int",
    "check_sample_rate",
    "check_steps",
]


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputTypeError(f"{name}={value!r} ({type(value).__name__}): expected a real number")
    number = float(value)
    if math.isnan(number):
        raise ConfigurationError(f"{name}=nan: expected a number")
    return number


def check_sample_rate(value: object, name: str = "sample_rate") -> float:
    q = _real(name, value)
    if not 0.0 < q <= 1.0:
        raise ConfigurationError(
            f"{name}={value!r}: expected a Poisson sampling rate q in (0, 1] (expected batch "
            "size / dataset size)"
        )
    return q


def check_noise_multiplier(value: object, name: str = "noise_multiplier") -> float:
    sigma = _real(name, value)
    if not 0.0 < sigma < math.inf:
        raise ConfigurationError(
            f"{name}={value!r}: expected a finite noise multiplier σ > 0 (noise std / "
            "sensitivity); σ = 0 is not private"
        )
    return sigma


def check_delta(value: object, name: str = "delta") -> float:
    delta = _real(name, value)
    if not 0.0 < delta < 1.0:
        raise ConfigurationError(
            f"{name}={value!r}: expected δ in (0, 1), typically well below 1 / dataset size"
        )
    return delta


def check_epsilon(value: object, name: str = "epsilon", *, positive: bool = False) -> float:
    eps = _real(name, value)
    if not math.isfinite(eps) or eps < 0.0 or (positive and eps == 0.0):
        bound = "> 0" if positive else "≥ 0"
        raise ConfigurationError(f"{name}={value!r}: expected a finite ε {bound}")
    return eps


def check_steps(value: object, name: str = "num_steps") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputTypeError(f"{name}={value!r} ({type(value).__name__}): expected an int")
    steps = int(value)
    if steps < 0:
        raise ConfigurationError(f"{name}={steps}: expected a number of steps ≥ 0")
    return steps


def check_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputTypeError(f"{name}={value!r} ({type(value).__name__}): expected an int")
    number = int(value)
    if number <= 0:
        raise ConfigurationError(f"{name}={number}: expected a positive int")
    return number
