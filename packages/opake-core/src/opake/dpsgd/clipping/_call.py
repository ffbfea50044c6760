"""One ``grad_fn`` call: its arguments checked, cast, and cut into chunks.

What :class:`~._grad_fn.ClippedGradFn` does with a call before and around its loop: the
state and ``end_step`` checked, enough positional arguments, one batch size over the batched
arguments, ``example_mask`` checked, floating-point arguments cast to ``compute_dtype``; the
checked call (:class:`Call`); and its chunks, slices of ``microbatch_size`` rows or whole
privacy units (:func:`chunks`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError
from opake.dpsgd.clipping._tree import DiffTree

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping._units import RowUnits
    from opake.dpsgd.clipping._base import ClipState
    from opake.dpsgd.clipping._units import UnitCall

__all__ = [
    "Call",
    "batch_size",
    "cast_floats",
    "check_args",
    "check_mask",
    "check_state",
    "chunks",
]


@dataclass(frozen=True)
class Call:
    """One ``grad_fn`` call, checked: what every chunk of it needs."""

    args: tuple[Any, ...]  # the differentiated argument replaced by its named leaves
    tree: DiffTree
    state: ClipState
    batch: int
    groups: tuple[int, ...] | None
    mask: torch.Tensor | None
    differentiable: bool
    small: bool
    units: UnitCall | None = None


def check_state(state: ClipState, kind: type, end_step: object) -> None:
    """``state`` is of the ``grad_fn``'s clipping method and ``end_step`` a bool."""
    if not isinstance(state, kind):
        raise ConfigurationError(
            f"grad_fn(state=...): got a {type(state).__name__}; this grad_fn was built for "
            f"{kind.__name__}: pass the state returned by clipped_grad or by the "
            "previous grad_fn call"
        )
    if not isinstance(end_step, bool):
        raise InputTypeError(f"grad_fn(end_step={end_step!r}): expected True or False")


def check_args(args: tuple[Any, ...], argnums: int, batch_argnums: tuple[int, ...]) -> DiffTree:
    """Enough positional arguments; the differentiated one as a :class:`DiffTree`."""
    needed = max(argnums, *batch_argnums) + 1
    if len(args) < needed:
        raise ConfigurationError(
            f"grad_fn got {len(args)} positional argument(s); argnums={argnums} and "
            f"batch_argnums={batch_argnums} need at least {needed}"
        )
    return DiffTree.of(args[argnums], argnums=argnums)


def batch_size(args: tuple[Any, ...], batch_argnums: tuple[int, ...]) -> int:
    """The one first dimension every tensor of the batched arguments has."""
    import torch
    from torch.utils._pytree import tree_leaves

    sizes: set[int] = set()
    for pos in batch_argnums:
        leaves = [x for x in tree_leaves(args[pos]) if isinstance(x, torch.Tensor)]
        if not leaves:
            raise InputTypeError(
                f"grad_fn: batch argument {pos} holds no tensor; batch_argnums must point at "
                "tensors (or pytrees of tensors) whose first dimension is the batch"
            )
        for leaf in leaves:
            if leaf.dim() == 0:
                raise ConfigurationError(
                    f"grad_fn: batch argument {pos} holds a 0-d tensor; every batched "
                    "tensor needs a leading batch dimension"
                )
            sizes.add(int(leaf.shape[0]))
    if len(sizes) != 1:
        raise ConfigurationError(
            f"grad_fn: batch arguments {batch_argnums} disagree on the batch size "
            f"({sorted(sizes)}); every batched tensor must have the same first dimension"
        )
    return sizes.pop()


def check_mask(mask: object, batch: int, device: torch.device) -> torch.Tensor | None:
    """``example_mask`` as a bool ``[batch]`` tensor on ``device`` (``None`` stays ``None``)."""
    import torch

    if mask is None:
        return None
    if (
        not isinstance(mask, torch.Tensor)
        or mask.dtype != torch.bool
        or tuple(mask.shape) != (batch,)
    ):
        raise InputTypeError(
            f"grad_fn(example_mask=...): expected a bool tensor of shape ({batch},), "
            f"got {getattr(mask, 'dtype', type(mask))} {tuple(getattr(mask, 'shape', ()))}"
        )
    return mask.to(device)


def cast_floats(args: tuple[Any, ...], dtype: torch.dtype) -> tuple[Any, ...]:
    """Every floating-point tensor in ``args`` in ``dtype`` (one already in it: not copied)."""
    import torch
    from torch.utils._pytree import tree_map

    def cast(x: object) -> object:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(dtype)
        return x

    return tuple(tree_map(cast, a) for a in args)


def _slices(
    args: tuple[Any, ...], batch: int, size: int | None, batch_argnums: tuple[int, ...]
) -> Iterator[tuple[int, int, tuple[Any, ...]]]:
    """``(start, stop, chunk_args)``: rows ``start:stop`` of the batched arguments, ``size``
    rows at a time (``None``: one chunk, the arguments themselves)."""
    import torch
    from torch.utils._pytree import tree_map

    step = size or batch
    for start in range(0, batch, step or 1):
        stop = min(start + step, batch)
        if start == 0 and stop == batch:
            yield start, stop, args
            continue

        def cut(x: object, a: int = start, b: int = stop) -> object:
            return x[a:b] if isinstance(x, torch.Tensor) else x

        yield (
            start,
            stop,
            tuple(tree_map(cut, arg) if i in batch_argnums else arg for i, arg in enumerate(args)),
        )


def chunks(
    call: Call, size: int | None, batch_argnums: tuple[int, ...], device: torch.device
) -> Iterator[tuple[tuple[Any, ...], int, torch.Tensor, RowUnits | None]]:
    """``(chunk_args, rows, is_real, units)`` per chunk: slices of ``size`` rows
    (``microbatch_size``), or whole privacy units (``units``: per unit, then)."""
    import torch

    if call.units is not None:
        yield from call.units.parts(call.args, batch_argnums)
        return
    for start, stop, chunk_args in _slices(call.args, call.batch, size, batch_argnums):
        is_real = (
            torch.ones(stop - start, dtype=torch.bool, device=device)
            if call.mask is None
            else call.mask[start:stop]
        )
        yield chunk_args, stop - start, is_real, None
