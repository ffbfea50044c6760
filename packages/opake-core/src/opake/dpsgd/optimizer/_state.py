"""Validation of a saved :class:`~opake.dpsgd.optimizer.DPOptimizer` state.

:func:`_checked_state` reads the dict of ``DPOptimizer.state_dict()`` and checks every entry
— the wrapped optimizer's state included (:func:`_check_wrapped`, what
``torch.optim.Optimizer.load_state_dict`` and the next ``step()`` would fail on) — before
anything is restored, so a bad state changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from opake.core.errors import ConfigurationError, InputTypeError
from opake.dpsgd.optimizer._options import _positive_float, _sample_rate

_STATE_VERSION = 1
_WRAPPED = "DPOptimizer state['optimizer']"
_FIX = (
    "pass the state saved by this run's DPOptimizer.state_dict(), with the wrapped optimizer "
    "built like the run that saved it (same parameter groups, same parameters, same order)"
)


class _SavedState(NamedTuple):
    steps: int
    checked: tuple[bool, bool]
    expected_batch_size: float
    sample_rate: float | None
    noise_multiplier: float
    noise: Any


def _checked_state(
    state: Any, param_names: Sequence[str], noise: Any, optimizer: Any
) -> _SavedState:
    """The entries of a saved state, each validated (raises before anything is restored).

    ``optimizer`` is the live wrapped ``torch.optim.Optimizer`` that ``state['optimizer']``
    will be loaded into; nothing of it (nor of ``noise``) is changed.
    """
    if not isinstance(state, Mapping):
        raise InputTypeError(
            f"DPOptimizer state={type(state).__name__}: expected the dict from state_dict()"
        )
    _check_header(state)
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
    _check_wrapped(state["optimizer"], optimizer)
    sigma = _positive_float("noise_multiplier", state["noise_multiplier"])
    noise_state = _checked_noise(state["noise"], noise, sigma)
    expected_batch_size = _positive_float("expected_batch_size", state["expected_batch_size"])
    sample_rate = None if state["sample_rate"] is None else _sample_rate(state["sample_rate"])
    return _SavedState(
        steps=steps,
        checked=(bool(checked[0]), bool(checked[1])),
        expected_batch_size=expected_batch_size,
        sample_rate=sample_rate,
        noise_multiplier=sigma,
        noise=noise_state,
    )


def _check_header(state: Mapping[str, Any]) -> None:
    """The saved state has exactly the keys this version writes, and this version."""
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


def _checked_noise(noise_state: Any, noise: Any, sigma: float) -> Any:
    """The saved noise state, checked against the live noise object and the saved σ."""
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
    if isinstance(noise_state, Mapping) and "noise_multiplier" in noise_state:
        # load_state_dict takes σ from the noise state: a check of the top-level σ must see it
        saved = noise_state["noise_multiplier"]
        if isinstance(saved, bool) or not isinstance(saved, int | float) or float(saved) != sigma:
            raise ConfigurationError(
                f"the saved state is inconsistent: noise_multiplier={sigma!r} but its noise "
                f"state holds noise_multiplier={saved!r} (the σ load_state_dict would restore); "
                "the state was edited or damaged — pass an unmodified DPOptimizer.state_dict()"
            )
    return noise_state


def _check_wrapped(saved: Any, optimizer: Any) -> None:
    """Refuse a wrapped-optimizer state that ``optimizer.load_state_dict`` would refuse, or
    that would break its next ``step()``; mirrors ``torch.optim.Optimizer.load_state_dict``."""
    if not isinstance(saved, Mapping) or not isinstance(saved.get("state"), Mapping):
        raise ConfigurationError(
            f"{_WRAPPED} is {type(saved).__name__}, not a torch optimizer state_dict() (a "
            f"mapping with a 'state' mapping and a 'param_groups' list); {_FIX}"
        )
    groups = saved.get("param_groups")
    if not isinstance(groups, list | tuple) or not all(
        isinstance(g, Mapping) and isinstance(g.get("params"), list | tuple) for g in groups
    ):
        raise ConfigurationError(
            f"{_WRAPPED}['param_groups'] must be a list of mappings, each with a 'params' "
            f"list of parameter ids; {_FIX}"
        )
    live = optimizer.param_groups
    if len(groups) != len(live):
        raise ConfigurationError(
            f"{_WRAPPED} has {len(groups)} parameter group(s) but the wrapped optimizer has "
            f"{len(live)}; {_FIX}"
        )
    params: dict[Any, Any] = {}
    for index, (group, mine) in enumerate(zip(groups, live, strict=True)):
        if len(group["params"]) != len(mine["params"]):
            raise ConfigurationError(
                f"{_WRAPPED}: parameter group {index} holds {len(group['params'])} "
                f"parameter(s) but the wrapped optimizer's holds {len(mine['params'])}; {_FIX}"
            )
        for pid, param in zip(group["params"], mine["params"], strict=True):
            try:
                known = pid in params
            except TypeError:  # unhashable: torch's id map would fail
                known = True
            if known:
                raise ConfigurationError(
                    f"{_WRAPPED}: parameter id {pid!r} is repeated or not a valid id in "
                    f"'param_groups'; {_FIX}"
                )
            params[pid] = param
    # the shape rule holds for torch's own optimizers; others (8-bit, preconditioned) may keep
    # state of other shapes and are left to their own load_state_dict and step()
    shapes = type(optimizer).__module__.startswith("torch.optim")
    for pid, entry in saved["state"].items():
        _check_param_state(pid, entry, params, shapes=shapes)


def _check_param_state(pid: Any, entry: Any, params: Mapping[Any, Any], *, shapes: bool) -> None:
    """One parameter's saved state: of a saved id, a mapping, its tensors shaped like it
    (``shapes``: a torch optimizer's)."""
    import torch

    try:
        param = params[pid]
    except (KeyError, TypeError):
        raise ConfigurationError(
            f"{_WRAPPED}['state'] has an entry for parameter id {pid!r}, which no saved "
            f"parameter group holds; {_FIX}"
        ) from None
    if not isinstance(entry, Mapping):
        raise ConfigurationError(
            f"{_WRAPPED}['state'][{pid!r}] is {type(entry).__name__}: expected the mapping of "
            f"that parameter's state (momentum_buffer, exp_avg, step, ...); {_FIX}"
        )
    for key, value in entry.items():
        empty = _without_values(value)
        if empty is not None:
            raise ConfigurationError(
                f"{_WRAPPED}['state'][{pid!r}][{key!r}] holds a {empty} tensor, which holds no "
                f"values torch can restore; {_FIX}"
            )
        if not shapes or not isinstance(value, torch.Tensor) or value.numel() == 1:
            continue  # scalars such as Adam's step
        if tuple(value.shape) not in _allowed_shapes(key, tuple(param.shape)):
            raise ConfigurationError(
                f"{_WRAPPED}['state'][{pid!r}][{key!r}] has shape {tuple(value.shape)} but "
                f"that parameter has shape {tuple(param.shape)}: the next step would fail; "
                f"{_FIX}"
            )


def _without_values(value: Any) -> str | None:
    """What kind of tensor in ``value`` (nested in lists, tuples and dicts, as torch's
    ``load_state_dict`` walks it) torch could not cast while restoring: meta or quantized."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.is_meta:
            return "meta"
        return "quantized" if value.is_quantized else None
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, list | tuple):
        for item in value:
            found = _without_values(item)
            if found is not None:
                return found
    return None


def _allowed_shapes(key: Any, shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The shapes a per-parameter state tensor may have: the parameter's, and for
    ``torch.optim.Adafactor``'s factored second moments the row and column shapes."""
    if key == "row_var" and len(shape) >= 2:
        return (shape, (*shape[:-1], 1))
    if key == "col_var" and len(shape) >= 2:
        return (shape, (*shape[:-2], 1, shape[-1]))
    return (shape,)
