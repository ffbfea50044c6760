"""What a logical step of :class:`~opake.dpsgd.training.DPTraining` did, and the budget error."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opake.core.errors import OperationError

__all__ = ["PrivacyBudgetExhausted", "StepResult"]


class PrivacyBudgetExhausted(OperationError):  # noqa: N818 (a state, not a bug: reads better)
    """The next step would spend more than the target ε: no data was touched for it."""


@dataclass(frozen=True)
class StepResult:
    """What one logical step did (the diagnostics are this rank's and **not private**).

    Attributes:
        step: logical steps taken so far, this one included.
        report: the :class:`~opake.dpsgd.optimizer.StepReport` of the DP optimizer (σ, noise
            std, expected batch size, sample rate, physical batches of all ranks).
        batch_size: real examples this rank processed in the step (padding excluded).
        loss_sum: sum of their losses.
        clipped: how many of them were clipped (of units, with privacy units).
        nonfinite: how many contributed zero because their gradient was not finite (units).
        aux: the clipping diagnostics (``ClipAux``) of each physical batch.
        units: with privacy units (``units=``), how many real units the step clipped (what
            ``clipped`` and ``clipping_rate`` count); ``None`` without.
    """

    step: int
    report: Any
    batch_size: int
    loss_sum: float
    clipped: int
    nonfinite: int = 0
    aux: tuple[Any, ...] = field(default=(), repr=False)
    units: int | None = None

    @property
    def loss(self) -> float:
        """Mean loss of this rank's real examples (``nan`` for an empty batch)."""
        return self.loss_sum / self.batch_size if self.batch_size else float("nan")

    @property
    def clipping_rate(self) -> float:
        """Fraction of this rank's real examples (units, with privacy units) that were clipped
        (0 for an empty batch)."""
        count = self.batch_size if self.units is None else self.units
        return self.clipped / count if count else 0.0


def _result(report: Any, pending: list[tuple[Any, Any]]) -> StepResult:
    import torch

    count = 0
    loss_sum = 0.0
    clipped = 0
    nonfinite = 0
    units: int | None = None
    for aux, mask in pending:
        losses = aux.loss_values
        real = int(aux.batch_size)  # units, with privacy units
        if mask is not None:  # padding slots of a fixed-shape batch: not examples
            losses = losses[mask.to(device=losses.device, dtype=torch.bool)]
        if getattr(aux, "unit_ids", None) is not None:
            units = (units or 0) + real
            count += losses.numel()
        else:
            count += real
        if losses.numel():
            loss_sum += float(losses.detach().float().sum())
        clipped += round(float(aux.clipping_rate) * real)
        nonfinite += int(getattr(aux, "nonfinite_count", 0) or 0)
    return StepResult(
        step=int(report.step),
        report=report,
        batch_size=count,
        loss_sum=loss_sum,
        clipped=clipped,
        nonfinite=nonfinite,
        aux=tuple(aux for aux, _ in pending),
        units=units,
    )
