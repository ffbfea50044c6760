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


def _expected_lora_a(zero: tuple[str, ...], skipped: tuple[str, ...]) -> tuple[str, ...]:
    """The PEFT LoRA ``A`` matrices among ``zero`` whose ``B`` partner did get a gradient.

    PEFT starts every ``B`` at zero, so ``A``'s gradient (``Bᵀ`` times the output's) is exactly
    zero until ``B`` moves, while ``B``'s own gradient is not: such an ``A`` is used by the loss.
    (An ``A`` whose ``B`` got no gradient either belongs to an unused layer: still reported.)
    """
    return tuple(
        name
        for name in zero
        if ".lora_A." in name
        and name.replace(".lora_A.", ".lora_B.") not in zero
        and name.replace(".lora_A.", ".lora_B.") not in skipped
    )


def _unused_message(skipped: tuple[str, ...], zero: tuple[str, ...]) -> str | None:
    """The first-step report of parameters without gradient (``None``: nothing to report).

    LoRA ``A`` matrices whose ``B`` partners start at zero are reported as what they are:
    expected, and moved by noise alone on that step, which costs no privacy (the same words as
    ``opake train``'s note).

    >>> note = _unused_message((), ("m.lora_A.default.weight",))
    >>> note.startswith("1 LoRA A matrices get no gradient on the first step"), "Freeze" in note
    (True, False)
    """
    lora = _expected_lora_a(zero, skipped)
    zero = tuple(name for name in zero if name not in lora)
    parts = []
    if skipped:
        parts.append(f"{', '.join(skipped)} received no gradient entry and will not be updated")
    if zero:
        parts.append(
            f"{', '.join(zero)} received an all-zero gradient from every example of a "
            "batch in which other parameters did not (probably unused by the loss); it "
            "would be updated by noise alone"
        )
    note = (
        f"{len(lora)} LoRA A matrices get no gradient on the first step (an all-zero gradient: "
        "their B partners start at zero), so that step moves them by noise alone; this is "
        f"expected and costs no privacy: {', '.join(lora[:4])}{', ...' if len(lora) > 4 else ''}"
    )
    if not parts:
        return note if lora else None
    return (
        "trainable parameter(s) without gradient: "
        + "; ".join(parts)
        + ". Freeze them (requires_grad_(False)) and leave them out of the optimizer. "
        "This check looks at the data of the first step(s): it is a diagnostic, not "
        "private." + (f" Also: {note}." if lora else "")
    )
