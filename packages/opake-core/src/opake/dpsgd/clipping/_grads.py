"""Result types of :func:`opake.dpsgd.clipping.clipped_grad`: the clipped sum and diagnostics."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

__all__ = ["ClipAux", "ClippedGrads"]


class ClippedGrads(dict[str, "torch.Tensor"]):
    """The fp32 sum of clipped per-example gradients (÷ ``normalize_by``), keyed like the input.

    A plain ``dict`` of tensors (same keys and shapes as the differentiated argument) that also
    carries what downstream code needs to add noise correctly:

    Attributes:
        max_norm: the L2 sensitivity of this sum — the largest change one example (added or
            removed) can make to it: ``C / normalize_by`` for fixed or adaptive clipping,
            ``sqrt(Σ C_k²) / normalize_by`` for group clipping, ``R / normalize_by`` for AUTO-S.
            Calibrate Gaussian noise as ``σ · max_norm``.
        batch_size: number of real examples summed (padding excluded by ``example_mask``;
            examples with non-finite gradients are included but contribute zero; with
            ``units=``, the number of units with a real row), as a 0-d
            int64 tensor on the gradients' device (read it with ``int()`` only when a host
            sync is acceptable).
        count_noise_multiplier: σ_b of the noisy count adaptive clipping released while
            computing this sum (``None`` for the other clipping methods); ``DPOptimizer`` refuses
            to account a step without it.

    Adding two results (``a + b``, e.g. accumulating physical batches of one logical step)
    sums the tensors and batch sizes; the sum's sensitivity is ``max(a.max_norm, b.max_norm)``
    because an example (a privacy unit, with ``units=``: keep each unit's rows in one physical
    batch) belongs to one physical batch only.

    >>> import torch
    >>> a = ClippedGrads({"w": torch.ones(2)}, max_norm=1.0, batch_size=torch.tensor(3))
    >>> b = ClippedGrads({"w": torch.ones(2)}, max_norm=1.0, batch_size=torch.tensor(2))
    >>> total = a + b
    >>> total["w"].tolist(), total.max_norm, int(total.batch_size)
    ([2.0, 2.0], 1.0, 5)
    """

    max_norm: float
    batch_size: torch.Tensor
    count_noise_multiplier: float | None = None

    def __init__(
        self,
        grads: Mapping[str, torch.Tensor],
        *,
        max_norm: float,
        batch_size: torch.Tensor | int,
    ) -> None:
        super().__init__(grads)
        self.max_norm = float(max_norm)
        if isinstance(batch_size, int):
            import torch

            batch_size = torch.tensor(batch_size, dtype=torch.int64)
        self.batch_size = batch_size

    def __add__(self, other: object) -> ClippedGrads:
        if not isinstance(other, ClippedGrads):
            return NotImplemented
        if self.keys() != other.keys():
            raise ConfigurationError(
                "ClippedGrads + ClippedGrads: the key sets differ "
                f"({sorted(self.keys() ^ other.keys())[:5]} ...); add results of the same "
                "grad_fn on the same parameters"
            )
        total = ClippedGrads(
            {name: value + other[name] for name, value in self.items()},
            max_norm=max(self.max_norm, other.max_norm),
            batch_size=self.batch_size + other.batch_size.to(self.batch_size.device),
        )
        total.count_noise_multiplier = self.count_noise_multiplier or other.count_noise_multiplier
        return total

    def __repr__(self) -> str:
        return (
            f"ClippedGrads({len(self)} tensors, max_norm={self.max_norm!r}, "
            f"batch_size={self.batch_size!r})"
        )


@dataclass(frozen=True)
class ClipAux:
    """Per-example diagnostics of one ``grad_fn`` call (``return_aux=True``).

    These values are **not private**: they are computed from individual examples without noise.
    Log or aggregate them only where that is acceptable, and never feed them back into
    training decisions without accounting for it.

    Attributes:
        loss_values: fp32 ``[B]`` per-example losses (padding examples included).
        grad_norms: fp32 ``[B]`` per-example gradient L2 norms before clipping (over every
            differentiated leaf; NaN/Inf for non-finite examples).
        clipped_grad_norms: fp32 ``[B]`` norms after clipping (0 for non-finite and padding
            examples).
        clipping_rate: fp32 0-d fraction of real examples whose gradient was scaled down (every
            example under AUTO-S; non-finite examples count as clipped); 0 for an empty batch.
        batch_size: int64 0-d number of real examples (as ``ClippedGrads.batch_size``).
        nonfinite_count: int64 0-d number of real examples whose gradient had a NaN/Inf entry
            (or a norm beyond fp64 range); each contributed zero to the sum.
        loss_aux: what ``loss_fn`` returned next to the loss (``has_aux=True``), stacked over
            the batch; ``None`` without ``has_aux`` or for an empty batch.
        group_grad_norms: fp32 ``[B]`` per-group norms before clipping (group clipping only).
        unit_ids: with privacy units (``grad_fn(..., units=ids)``), the distinct ids ``[U]`` in
            ascending order, else ``None``. Then ``grad_norms``, ``clipped_grad_norms`` and
            ``group_grad_norms`` are per unit ``[U]`` in that order (the norm of the unit's
            summed gradient), ``clipping_rate``, ``batch_size`` and ``nonfinite_count`` count
            units; ``loss_values`` and ``loss_aux`` stay per row ``[B]``, in row order.
    """

    loss_values: torch.Tensor
    grad_norms: torch.Tensor
    clipped_grad_norms: torch.Tensor
    clipping_rate: torch.Tensor
    batch_size: torch.Tensor
    nonfinite_count: torch.Tensor
    loss_aux: Any = None
    group_grad_norms: Mapping[str, torch.Tensor] | None = None
    unit_ids: torch.Tensor | None = None
