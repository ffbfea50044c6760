"""What the Gaussian mechanism accepts: σ, the gradients, their sensitivity, a device.

Implementation module behind :mod:`opake.dpsgd.noise` (used by :mod:`._gaussian`). The
sensitivity has one source of truth: ``grads.max_norm`` (what ``clipped_grad`` returns) or
``sensitivity=``, and both given must agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, SupportsFloat, SupportsIndex

from opake.core.errors import ConfigurationError, InputTypeError

if TYPE_CHECKING:
    import torch

__all__ = ["as_device", "check_grads", "check_noise_multiplier", "resolve_sensitivity"]


def check_noise_multiplier(value: object) -> float:
    """σ as a float: a finite number > 0 (never a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputTypeError(
            f"noise_multiplier={value!r} ({type(value).__name__}): expected a positive float σ"
        )
    sigma = float(value)
    if not math.isfinite(sigma) or sigma <= 0.0:
        raise ConfigurationError(
            f"noise_multiplier={value!r}: expected a finite σ > 0 (σ = 0 adds no noise and is not "
            "private; use opake.accounting.calibrate_noise to pick σ for a target ε)"
        )
    return sigma


def resolve_sensitivity(grads: Mapping[str, object], sensitivity: object) -> float:
    """The sensitivity S: ``sensitivity`` or ``grads.max_norm``, finite and > 0; both given
    must agree (the noise is calibrated to the bound the gradients were clipped to)."""
    carried = getattr(grads, "max_norm", None)
    values: list[tuple[str, object]] = []
    if sensitivity is not None:
        values.append(("sensitivity", sensitivity))
    if carried is not None:
        values.append(("grads.max_norm", carried))
    if not values:
        raise ConfigurationError(
            "no sensitivity: pass sensitivity= (the L2 bound C of the summed clipped gradients) "
            "or the dict returned by clipped_grad's grad_fn, which carries max_norm"
        )
    resolved = []
    for name, value in values:
        wrong = f"{name}={value!r} ({type(value).__name__}): expected a float"
        if not isinstance(value, SupportsFloat | SupportsIndex | str | bytes):
            raise InputTypeError(wrong)  # what float() would refuse with a TypeError
        try:
            number = float(value)
        except (TypeError, ValueError) as err:
            raise InputTypeError(wrong) from err
        if not math.isfinite(number) or number <= 0.0:
            raise ConfigurationError(
                f"{name}={value!r}: expected a finite sensitivity > 0 (the clipping bound C "
                "divided by normalize_by)"
            )
        resolved.append(number)
    if len(resolved) == 2 and not math.isclose(resolved[0], resolved[1], rel_tol=1e-6):
        raise ConfigurationError(
            f"sensitivity={resolved[0]!r} disagrees with grads.max_norm={resolved[1]!r}: the noise "
            "must be calibrated to the bound the gradients were clipped to; drop sensitivity= "
            "and let the gradients carry it"
        )
    return resolved[0]


def check_grads(grads: object) -> None:
    """``grads`` is a mapping name → real floating-point tensor."""
    import torch

    if not isinstance(grads, Mapping):
        raise InputTypeError(
            f"grads={type(grads).__name__}: expected a name -> tensor dict (what clipped_grad's "
            "grad_fn returns)"
        )
    for name, value in grads.items():
        if not isinstance(value, torch.Tensor):
            raise InputTypeError(f"grads[{name!r}]={type(value).__name__}: expected a torch.Tensor")
        if not value.is_floating_point():
            raise InputTypeError(
                f"grads[{name!r}] has dtype {value.dtype}: expected a real floating-point tensor"
            )


def as_device(device: object) -> torch.device:
    """``GaussianNoise(device=...)`` (accepted for compatibility) as a ``torch.device``."""
    import torch

    wrong = f"device={device!r}: expected a torch.device or a string like 'cpu' or 'cuda:0'"
    if not isinstance(device, torch.device | str | int):
        raise InputTypeError(wrong)
    try:
        return torch.device(device)
    except (TypeError, RuntimeError) as err:
        raise InputTypeError(wrong) from err
