"""Reference fused clip-and-accumulate: ``sums[j] += Σ_i factors[i, j] · nan_to_num(grads[j][i])``.

The vmap clipping engine's scale-and-sum, one leaf at a time in plain PyTorch: an fp32 copy of
each leaf's per-example gradients with non-finite entries read as 0 (a non-finite example has
factor 0, and ``0 · NaN`` must not poison the sum), then one matrix-vector product. Every other
backend's ``clip_accumulate`` is tested against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from opake.core.errors import ConfigurationError, InputTypeError

if TYPE_CHECKING:
    import torch

__all__ = ["check_clip_args", "clip_accumulate"]


def check_clip_args(
    grads: Sequence[torch.Tensor], factors: torch.Tensor, sums: Sequence[torch.Tensor]
) -> None:
    """Raise a typed error unless ``grads[j]`` is ``[m, *shape_j]``, ``sums[j]`` the fp32
    ``shape_j`` accumulator and ``factors`` ``[m, len(grads)]``.

    >>> import torch
    >>> check_clip_args([torch.ones(2, 3)], torch.ones(2, 1), [torch.zeros(3)])
    """
    import torch

    for name, seq in (("grads", grads), ("sums", sums)):
        if isinstance(seq, torch.Tensor) or not isinstance(seq, Sequence):
            raise InputTypeError(
                f"clip_accumulate: {name} must be a list of tensors (one per leaf), got "
                f"{type(seq).__name__}."
            )
        for t in seq:
            if not isinstance(t, torch.Tensor):
                raise InputTypeError(
                    f"clip_accumulate: {name} holds a {type(t).__name__}; expected tensors."
                )
    if not isinstance(factors, torch.Tensor):
        raise InputTypeError(
            f"clip_accumulate: factors must be a [m, leaves] tensor, got {type(factors).__name__}."
        )
    if len(grads) != len(sums) or factors.dim() != 2 or factors.shape[1] != len(grads):
        raise ConfigurationError(
            f"clip_accumulate: {len(grads)} gradients, {len(sums)} sums and factors of shape "
            f"{tuple(factors.shape)}; expected one sum per gradient and factors [m, leaves]"
        )
    m = factors.shape[0]
    for j, (g, s) in enumerate(zip(grads, sums, strict=True)):
        if g.dim() < 1 or g.shape[0] != m or g.shape[1:] != s.shape:
            raise ConfigurationError(
                f"clip_accumulate: leaf {j} has per-example gradients of shape {tuple(g.shape)} "
                f"and a sum of shape {tuple(s.shape)}; expected [{m}, *sum.shape]"
            )
        if s.dtype != torch.float32:
            raise ConfigurationError(
                f"clip_accumulate: leaf {j}'s sum is {s.dtype}; the accumulators must be fp32."
            )


def clip_accumulate(
    grads: Sequence[torch.Tensor], factors: torch.Tensor, sums: Sequence[torch.Tensor]
) -> str:
    """``sums[j] += Σ_i factors[i, j] · nan_to_num(grads[j][i])`` in place; returns ``"torch"``.

    ``grads[j]`` is ``[m, *shape_j]`` (per-example gradients, any float dtype), ``factors``
    ``[m, L]``, ``sums[j]`` the fp32 ``shape_j`` accumulator. The inputs are not modified.

    >>> import torch
    >>> sums = [torch.zeros(2)]
    >>> clip_accumulate([torch.tensor([[1.0, float("nan")], [3.0, 4.0]])],
    ...                 torch.tensor([[0.5], [1.0]]), sums)
    'torch'
    >>> sums[0].tolist()
    [3.5, 4.0]
    """
    import torch

    check_clip_args(grads, factors, sums)
    table = factors.to(torch.float32)
    for j, (g, total) in enumerate(zip(grads, sums, strict=True)):
        # fp64 gradients: scaled and summed in fp64, rounded to fp32 once (a conversion before
        # the factor would let a factor above 1 multiply its subnormal-range error)
        wide = torch.float64 if g.dtype == torch.float64 else torch.float32
        flat = g.reshape(g.shape[0], -1).to(wide).nan_to_num(0.0, 0.0, 0.0)
        contrib = (table[:, j].to(device=flat.device, dtype=wide) @ flat).to(torch.float32)
        total.add_(contrib.reshape(total.shape))
    return "torch"
