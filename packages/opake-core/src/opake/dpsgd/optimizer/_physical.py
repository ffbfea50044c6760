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
