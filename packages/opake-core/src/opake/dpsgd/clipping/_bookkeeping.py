"""The book-keeping engine behind the engine protocol (:class:`~._chunks.ChunkEngine`).

:class:`~opake.dpsgd.bookkeeping._runner.BookkeepingRunner` runs one batched forward and
backward per chunk and keeps, per layer, the pieces that give each example's per-leaf squared
norms and, later, any factor-weighted sum of the per-example gradients without forming them.
This adapter maps that onto the protocol: ``chunk`` → losses, norms (clip with the certified
bounds), aux; ``accumulate`` → the weighted sum of the pieces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opake.dpsgd.clipping._chunks import ChunkOut

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping._runner import BookkeepingRunner
    from opake.dpsgd.bookkeeping._units import RowUnits
    from opake.dpsgd.clipping._base import ClipFactors

__all__ = ["BookkeepingEngine"]


class BookkeepingEngine:
    """The book-keeping engine for one ``grad_fn`` call.

    ``per_example`` is the one-example loss the first-call check compares against (plain
    autograd on one example); ``check``: run that check when it is due.
    """

    name = "bookkeeping"

    def __init__(
        self,
        runner: BookkeepingRunner,
        per_example: Callable[..., Any],
        *,
        names: tuple[str, ...],
        check: bool,
    ) -> None:
        import torch

        self.runner = runner
        self.per_example = per_example
        self.names = names
        self.check = check
        # hooks, a ContextVar of taps and host-side checks do not trace: a torch.compile that
        # falls back to eager (no fullgraph) must not compile these frames one by one either
        # (mypy refuses assigning to a method: these instance attributes shadow the methods)
        disable: Callable[[Callable[..., Any]], Any] = torch.compiler.disable
        self.chunk = disable(self.chunk)  # type: ignore[method-assign]
        self.accumulate = disable(self.accumulate)  # type: ignore[method-assign]

    def chunk(self, args: tuple[Any, ...], m: int, units: RowUnits | None = None) -> ChunkOut:
        """One batched forward/backward: losses, per-leaf squared norms (per unit with
        ``units``: the pieces are regrouped first), aux."""
        record = self.runner.run_checked(args, m, self.per_example, check=self.check, units=units)
        # clip with bounds that rounding cannot shrink (see bookkeeping._certify)
        bound_sq = record.leaf_sq if record.clip_sq is None else record.clip_sq
        return ChunkOut(
            loss=record.loss,
            leaf_sq=record.leaf_sq,
            bound_sq=bound_sq,
            aux=record.aux,
            payload=record,
            slack=record.slack,
        )

    def accumulate(
        self, out: ChunkOut, factors: ClipFactors, sums: dict[str, torch.Tensor]
    ) -> None:
        """Add the factor-weighted sum of the chunk's per-example gradients to ``sums``."""
        out.payload.accumulate(self.names, factors.leaf_factor, factors.contributes, sums)
