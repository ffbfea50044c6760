"""Helpers of one logical step: the noise call, physical batch arguments, the step's aux."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError, OperationError

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.optimizer._report import StepReport


def _noised(
    noise: Any, sums: Mapping[str, torch.Tensor], sensitivity: float
) -> tuple[Mapping[str, torch.Tensor], bool]:
    """The noised sums, and whether they are ``sums``' own tensors (noised in place: the caller
    may then finish them in place too)."""
    import torch

    from opake.dpsgd.noise import GaussianNoise

    # a GaussianNoise whose add() is not overridden: the sums are the optimizer's own, so noise
    # them in place (no second gradient-sized copy); a subclass's add() is always honoured
    in_place = (
        isinstance(noise, GaussianNoise)
        and type(noise).add is GaussianNoise.add
        and all(
            v.is_contiguous() and v.dtype in (torch.float32, torch.float64) for v in sums.values()
        )
    )
    if in_place:
        noised: Mapping[str, torch.Tensor] = noise.add_(sums, sensitivity=sensitivity)
        return noised, True
    out = noise.add(dict(sums), sensitivity=sensitivity)
    if isinstance(out, tuple):  # (grads, info) style
        out = out[0]
    if not isinstance(out, Mapping):
        raise OperationError(
            f"noise.add returned {type(out).__name__}; expected the name -> tensor dict"
        )
    return out, False


def _same_keys(noisy: Mapping[str, Any], sums: Mapping[str, Any]) -> None:
    """A noise object returns exactly the entries it was given."""
    extra = [name for name in noisy if name not in sums]
    if extra:
        raise OperationError(
            f"the noise object returned an entry {extra[0]!r} that was not in the gradient "
            "sum; it must return the same keys it was given"
        )
    if set(noisy) != set(sums):
        raise OperationError(
            f"the noise object dropped entries {sorted(set(sums) - set(noisy))}; it must return "
            "every key it was given"
        )


def checked_grads(grads: object, params: Mapping[str, torch.Tensor]) -> float:
    """The sensitivity (``max_norm``) of ``grads``, one physical batch's clipped sum for the
    parameters ``params``, after checking that it is ``clipped_grad``'s result for them."""
    import math

    import torch

    if not isinstance(grads, Mapping):
        raise InputTypeError(
            f"grads={type(grads).__name__}: expected the name -> tensor dict returned by "
            "clipped_grad's grad_fn"
        )
    max_norm = getattr(grads, "max_norm", None)
    if max_norm is None:
        raise InputTypeError(
            "grads carries no max_norm (its L2 sensitivity): pass the dict returned by "
            "clipped_grad's grad_fn, not a plain dict, so noise is calibrated from the result"
        )
    sensitivity = float(max_norm)
    if not math.isfinite(sensitivity) or sensitivity <= 0.0:
        raise ConfigurationError(
            f"grads.max_norm={max_norm!r}: expected a finite sensitivity > 0 (the clipping "
            "bound of the summed gradients)"
        )
    for name, value in grads.items():
        param = params.get(name)
        if param is None:
            known = ", ".join(params) or "none"
            raise ConfigurationError(
                f"gradient for {name!r}, which the optimizer does not update (its parameters: "
                f"{known}); give the optimizer every trainable tensor, or freeze {name!r}"
            )
        if not isinstance(value, torch.Tensor):
            raise InputTypeError(f"grads[{name!r}]={type(value).__name__}: expected a torch.Tensor")
        if value.shape != param.shape:
            raise ConfigurationError(
                f"grads[{name!r}] has shape {tuple(value.shape)} but the parameter has "
                f"{tuple(param.shape)}; pass per-parameter sums, not per-example gradients"
            )
    return sensitivity


def _split_batch(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(batch, tuple):
        return batch, {}
    if isinstance(batch, Mapping) and isinstance(batch.get("args"), tuple):
        kwargs = {k: v for k, v in batch.items() if k != "args"}
        if "state" in kwargs or "end_step" in kwargs:
            raise ConfigurationError(
                "a batch dict may not set 'state' or 'end_step': logical_step manages them"
            )
        return batch["args"], kwargs
    raise InputTypeError(
        f"batches yielded {type(batch).__name__}: expected a tuple of grad_fn arguments after "
        "params, e.g. (x, y), or a dict {'args': (x, y), 'example_mask': mask}"
    )


def _accepts_keyword(fn: Callable[..., Any], name: str) -> bool:
    import inspect

    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _with_aux(report: StepReport, aux: tuple[Any, ...]) -> StepReport:
    from dataclasses import replace

    return replace(report, aux=aux)
