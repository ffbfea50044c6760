"""Privacy units in one ``grad_fn`` call: the ids checked, the batch cut into whole units.

``grad_fn(*args, state=state, units=ids)`` clips each unit's gradient — the sum of its rows'
gradients — as a whole (:mod:`opake.dpsgd.bookkeeping._units` says how each engine reduces a
unit to an "example"). This module plans the call: the distinct ids (ascending: the order of
the per-unit diagnostics), each row's unit, and the chunks, which hold whole units only — the
running fp32 sum adds whole units' clipped sums, never a part of a unit. A unit with more rows
than ``microbatch_size`` gets a chunk of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opake.core.errors import InputTypeError
from opake.dpsgd.bookkeeping._units import RowUnits

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.clipping._grads import ClipAux

__all__ = ["UnitCall", "check_units"]


def check_units(units: object, batch: int, device: torch.device) -> torch.Tensor | None:
    """``units`` as int64 ``[batch]`` on ``device`` (``None`` stays ``None``), or a typed error.

    >>> import torch
    >>> check_units(torch.tensor([3, 3, 1]), 3, torch.device("cpu")).tolist()
    [3, 3, 1]
    """
    import torch

    if units is None:
        return None
    if (
        not isinstance(units, torch.Tensor)
        or units.dtype == torch.bool
        or units.is_floating_point()
        or units.is_complex()
        or tuple(units.shape) != (batch,)
    ):
        raise InputTypeError(
            f"grad_fn(units=...): expected an integer tensor of shape ({batch},) giving each "
            f"row's privacy unit (any ids: equal ids form one unit), got "
            f"{getattr(units, 'dtype', type(units).__name__)} "
            f"{tuple(getattr(units, 'shape', ()))}"
        )
    return units.to(device=device, dtype=torch.int64)


@dataclass(frozen=True)
class UnitCall:
    """The units of one call: ``ids`` ``[U]`` (distinct, ascending), ``inverse`` ``[B]`` (each
    row's unit), ``ranges`` (the units of each chunk), ``order`` (rows sorted by unit, stable),
    ``mask`` (the call's ``example_mask``, or ``None``)."""

    ids: torch.Tensor
    inverse: torch.Tensor
    counts: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    order: torch.Tensor
    mask: torch.Tensor | None

    @classmethod
    def plan(
        cls, units: torch.Tensor, mask: torch.Tensor | None, microbatch_size: int | None
    ) -> UnitCall:
        """Group the rows and cut the chunks (greedily, in unit order; one host sync).

        >>> import torch
        >>> call = UnitCall.plan(torch.tensor([7, 2, 7, 5, 2, 7]), None, 4)
        >>> call.ids.tolist(), call.counts, call.ranges
        ([2, 5, 7], (2, 1, 3), ((0, 2), (2, 3)))
        """
        import torch

        ids, inverse, counts = torch.unique(units, return_inverse=True, return_counts=True)
        sizes = tuple(int(c) for c in counts.tolist())
        limit = microbatch_size or max(1, len(units))
        ranges: list[tuple[int, int]] = []
        start, rows = 0, 0
        for u, size in enumerate(sizes):
            if u > start and rows + size > limit:
                ranges.append((start, u))
                start, rows = u, 0
            rows += size
        if sizes:
            ranges.append((start, len(sizes)))
        order = torch.sort(inverse, stable=True).indices
        return cls(ids, inverse, sizes, tuple(ranges), order, mask)

    @property
    def gathered(self) -> bool:
        """More than one chunk: each chunk's rows are gathered (in unit order)."""
        return len(self.ranges) > 1

    def real_count(self) -> torch.Tensor:
        """The number of units with at least one real row (0-d int64)."""
        return RowUnits(self.inverse, len(self.counts), self.mask).unit_real.sum()

    def parts(
        self, args: tuple[Any, ...], batch_argnums: tuple[int, ...]
    ) -> Iterator[tuple[tuple[Any, ...], int, torch.Tensor, RowUnits]]:
        """``(chunk_args, rows, is_real [units], RowUnits)`` for every chunk."""
        import torch
        from torch.utils._pytree import tree_map

        if not self.gathered:
            for _ in self.ranges:
                units = RowUnits(self.inverse, len(self.counts), self.mask)
                yield args, len(self.inverse), units.unit_real, units
            return
        cum = [0]
        for size in self.counts:
            cum.append(cum[-1] + size)
        for u0, u1 in self.ranges:
            rows = self.order[cum[u0] : cum[u1]]

            def cut(x: object, rows: torch.Tensor = rows) -> object:
                return x[rows] if isinstance(x, torch.Tensor) else x

            chunk = tuple(
                tree_map(cut, arg) if i in batch_argnums else arg for i, arg in enumerate(args)
            )
            real = None if self.mask is None else self.mask[rows]
            units = RowUnits(self.inverse[rows] - u0, u1 - u0, real)
            yield chunk, int(rows.shape[0]), units.unit_real, units

    def finish(self, aux: ClipAux) -> ClipAux:
        """The call's :class:`ClipAux` with per-row values back in row order and the ids."""
        import torch
        from torch.utils._pytree import tree_map

        if not self.gathered:
            return dataclasses.replace(aux, unit_ids=self.ids)
        back = torch.empty_like(self.order)
        back[self.order] = torch.arange(len(self.order), device=self.order.device)

        def restore(x: object) -> object:
            return x[back] if isinstance(x, torch.Tensor) else x

        return dataclasses.replace(
            aux,
            loss_values=aux.loss_values[back],
            loss_aux=tree_map(restore, aux.loss_aux),
            unit_ids=self.ids,
        )
