"""Validation of a saved :class:`~opake.dpsgd.optimizer.DPOptimizer` state.

:func:`_checked_state` reads the dict of ``DPOptimizer.state_dict()`` and checks every entry
before anything is restored, so a bad state changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from opake.core.errors import ConfigurationError, InputTypeError
from opake.dpsgd.optimizer._options import _positive_float, _sample_rate

_STATE_VERSION = 1


class _SavedState(NamedTuple):
    steps: int
    checked: tuple[bool, bool]
    expected_batch_size: float
    sample_rate: float | None
    noise_multiplier: float
    noise: Any


def _checked_state(state: Any, param_names: Sequence[str], noise: Any) -> _SavedState:
    """The entries of a saved state, each validated (raises before anything is restored)."""
    if not isinstance(state, Mapping):
        raise InputTypeError(
            f"DPOptimizer state={type(state).__name__}: expected the dict from state_dict()"
        )
    expected = {
        "version",
        "steps",
        "unused_checked",
        "param_names",
        "noise_multiplier",
        "expected_batch_size",
        "sample_rate",
        "optimizer",
        "noise",
    }
    if set(state) != expected:
        missing = sorted(expected - set(state))
        extra = sorted(set(state) - expected)
        raise ConfigurationError(
            f"DPOptimizer state has missing keys {missing} and unexpected keys {extra}; pass "
            "the dict from DPOptimizer.state_dict()"
        )
    if state["version"] != _STATE_VERSION:
        raise ConfigurationError(
            f"DPOptimizer state version {state['version']!r}: this Opake reads version "
            f"{_STATE_VERSION}"
        )
    steps = state["steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigurationError(f"DPOptimizer state steps={steps!r}: expected an int ≥ 0")
    checked = state["unused_checked"]
    if (
        not isinstance(checked, list | tuple)
        or len(checked) != 2
        or not all(isinstance(flag, bool) for flag in checked)
    ):
        raise ConfigurationError(
            f"DPOptimizer state unused_checked={checked!r}: expected two booleans"
        )
    if list(state["param_names"]) != list(param_names):
        raise ConfigurationError(
            f"DPOptimizer state was saved for parameters {list(state['param_names'])} but "
            f"this optimizer updates {list(param_names)}; build the optimizer over the same "
            "parameters, in the same order"
        )
    noise_state = state["noise"]
    if (noise_state is None) != (not hasattr(noise, "load_state_dict")):
        raise ConfigurationError(
            "DPOptimizer state and this optimizer's noise object disagree on whether the "
            "noise generator has a state; use the same kind of noise object"
        )
    check_noise = getattr(noise, "check_state", None)
    if noise_state is not None and callable(check_noise):
        # before anything is restored: a malformed noise state, or one that would rewind a live
        # secure source (released noise drawn again), leaves the optimizer as it was
        check_noise(noise_state)
    expected_batch_size = _positive_float("expected_batch_size", state["expected_batch_size"])
    sample_rate = None if state["sample_rate"] is None else _sample_rate(state["sample_rate"])
    sigma = _positive_float("noise_multiplier", state["noise_multiplier"])
    return _SavedState(
        steps=steps,
        checked=(bool(checked[0]), bool(checked[1])),
        expected_batch_size=expected_batch_size,
        sample_rate=sample_rate,
        noise_multiplier=sigma,
        noise=noise_state,
    )
