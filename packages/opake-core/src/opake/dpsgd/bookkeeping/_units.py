"""Privacy units: the rows of a chunk grouped into units, and pieces regrouped per unit.

A *unit* (a user, a DPO pair) is what is clipped as a whole: its gradient is the sum of its
rows' gradients. Both engines reduce units to "examples" so that the certified machinery of
:mod:`opake.dpsgd.certify` applies verbatim, to the very tensors that are then summed:

- a per-row tensor ``[m, *s]`` (the vmap engine's per-example gradients, a :class:`Dense`
  piece) becomes ``[U, *s]``, each unit's real rows summed (fp32, fp64 kept): the norm is
  bounded on that summed tensor and the clipped sum adds ``w_u`` times exactly it;
- an :class:`OuterSum` ``a [m, T, R]``, ``b [m, T, C]`` becomes ``[U, k·T, ·]``: each unit's
  rows laid end to end along the tokens (``k`` the most rows of any unit), zero-padded. Zero
  tokens add exactly zero to every Gram entry, every token-norm sum and every product, so the
  regrouped piece *is* an ``OuterSum`` whose per-example gradient is the unit's gradient;
- an :class:`Implicit` operator cannot be regrouped unless it offers the ``OuterSum`` it
  certifies itself from (``outer_view()``, a first-party certified operator); otherwise
  :class:`UnitsUnsupportedError` (``clipped_grad`` then uses the vmap engine for unit calls,
  or raises for an explicit ``engine="bookkeeping"``).

Rows whose ``real`` entry is false (the padding of a fixed-shape batch) are left out of their
unit: exact zeros, whatever they hold (NaN included).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from opake.core.errors import OperationError
from opake.dpsgd.bookkeeping._pieces import Dense, Implicit, OuterSum, Piece

if TYPE_CHECKING:
    import torch

__all__ = ["RowUnits", "UnitsUnsupportedError", "regroup"]


class UnitsUnsupportedError(OperationError):
    """A recorded piece cannot be regrouped per unit (an operator that holds per-example
    gradients implicitly): the book-keeping engine cannot clip these units."""


@dataclass(frozen=True)
class RowUnits:
    """How the ``m`` rows of one chunk group into ``count`` units.

    ``index`` ``[m]`` int64: the unit of each row, in ``[0, count)``; ``real`` ``[m]`` bool or
    ``None`` (every row real): rows that take part in their unit's gradient.

    >>> import torch
    >>> units = RowUnits(torch.tensor([1, 0, 1]), 2)
    >>> units.sum_rows(torch.tensor([[1.0], [2.0], [3.0]])).tolist()
    [[2.0], [4.0]]
    >>> units.stack_rows(torch.tensor([[1.0], [2.0], [3.0]])).tolist()
    [[2.0, 0.0], [1.0, 3.0]]
    """

    index: torch.Tensor
    count: int
    real: torch.Tensor | None = None
    _last: list[tuple[tuple[Any, ...], torch.Tensor, torch.Tensor]] = field(
        default_factory=list, compare=False, repr=False
    )

    @property
    def rows(self) -> int:
        """Rows ``m`` of the chunk."""
        return int(self.index.shape[0])

    @cached_property
    def layout(self) -> tuple[torch.Tensor, int]:
        """``(slot [m], width)``: each row's position among its unit's rows (in row order) and
        the most rows of any unit."""
        import torch

        index = self.index
        if not self.rows:
            return index.clone(), 1
        order = torch.sort(index, stable=True).indices
        counts = torch.bincount(index, minlength=self.count)
        starts = counts.cumsum(0) - counts
        slot = torch.empty_like(index)
        slot[order] = torch.arange(self.rows, device=index.device) - starts[index[order]]
        return slot, max(1, int(counts.max()))

    @cached_property
    def identity(self) -> bool:
        """Every row its own unit, in order, all real: regrouping changes nothing."""
        import torch

        if self.count != self.rows or self.real is not None:
            return False
        return bool((self.index == torch.arange(self.rows, device=self.index.device)).all())

    @cached_property
    def unit_real(self) -> torch.Tensor:
        """``[count]`` bool: the unit has at least one real row."""
        import torch

        real = torch.ones_like(self.index) if self.real is None else self.real.long()
        counts = torch.zeros(self.count, dtype=torch.int64, device=self.index.device)
        return counts.index_add_(0, self.index, real) > 0

    def members(self, unit: int) -> list[int]:
        """The real rows of ``unit``, in row order."""
        inside = self.index == unit
        if self.real is not None:
            inside = inside & self.real
        return [int(i) for i in inside.nonzero().flatten().tolist()]

    def _masked(self, x: torch.Tensor) -> torch.Tensor:
        import torch

        if self.real is None or not x.is_floating_point():
            return x
        keep = self.real.reshape(-1, *([1] * (x.dim() - 1)))
        return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))

    def sum_rows(self, g: torch.Tensor) -> torch.Tensor:
        """``[m, *s]`` → ``[count, *s]``: each unit's real rows summed (in fp32; an fp64
        tensor in fp64). Differentiable (an outer ``torch.func`` transform may run it)."""
        import torch

        dtype = torch.promote_types(g.dtype, torch.float32)
        out = torch.zeros(self.count, *g.shape[1:], dtype=dtype, device=g.device)
        return out.index_add(0, self.index, self._masked(g).to(dtype))

    def stack_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``[m, T, *f]`` → ``[count, width·T, *f]``: each unit's rows end to end along the
        tokens, in row order, zero-padded (a masked row reads as zeros; int ids as they are,
        their other factor being zero). A tensor regrouped before (one input read by several
        layers in a row) gives the same regrouped tensor, so the Gram cache still shares it."""
        import torch

        key = (x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, x.device, x._version)
        if self._last and self._last[0][0] == key:
            return self._last[0][2]
        slot, width = self.layout
        steps = int(x.shape[1])
        out = torch.zeros(self.count, width, *x.shape[1:], dtype=x.dtype, device=x.device)
        out[self.index, slot] = self._masked(x)
        out = out.reshape(self.count, width * steps, *x.shape[2:])
        # one entry (consecutive uses of one input: q/k/v, gate/up); the source stays alive
        # while its key may be looked up, so its memory cannot be another tensor's meanwhile
        self._last[:] = [(key, x, out)]
        return out

    def release(self) -> None:
        """Drop the regrouped tensor kept for sharing (after the pieces are built)."""
        self._last.clear()


def _outer_view(op: object) -> Callable[[], OuterSum] | None:
    from opake.dpsgd.bookkeeping._certify import certified_operator

    view = getattr(op, "outer_view", None)
    return view if callable(view) and certified_operator(op) else None


def regroup(piece: Piece, units: RowUnits) -> Piece:
    """``piece`` (per row) as the same kind of piece per unit (see the module docstring)."""
    if units.identity:
        return piece
    if isinstance(piece, Dense):
        return Dense(units.sum_rows(piece.g))
    if isinstance(piece, OuterSum):
        return OuterSum(units.stack_rows(piece.a), units.stack_rows(piece.b), rows=piece.rows)
    assert isinstance(piece, Implicit)
    view = _outer_view(piece.op)
    if view is not None:
        outer = view()
        if isinstance(outer, OuterSum):
            return OuterSum(units.stack_rows(outer.a), units.stack_rows(outer.b), rows=outer.rows)
    op = type(piece.op)
    raise UnitsUnsupportedError(
        f"book-keeping: per-example gradients held by {op.__module__}.{op.__qualname__} (an "
        "operator that computes norms and sums itself) cannot be summed per privacy unit; "
        "units= runs on the vmap engine for such models"
    )
