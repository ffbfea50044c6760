"""Privacy units passed to ``DPTraining.accumulate`` / ``step``: checked, and kept whole.

``DPTraining`` passes ``units=`` through to ``grad_fn`` (which clips each unit as a whole). What
it checks here is what ``grad_fn`` cannot see: a unit must not reach the step in two physical
batches (its two parts would be clipped separately: a sensitivity of 2C), nor on two ranks —
which nothing shards by unit yet, so ``units=`` is refused under ``torch.distributed``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

__all__ = ["StepUnits"]


def _batch_leaf(batch: tuple[Any, ...]) -> torch.Tensor | None:
    import torch
    from torch.utils._pytree import tree_leaves

    leaves = [x for x in tree_leaves(batch) if isinstance(x, torch.Tensor) and x.dim() > 0]
    return leaves[0] if leaves else None


class StepUnits:
    """The units of the logical step in progress (each in one physical batch only).

    >>> import torch
    >>> units = StepUnits()
    >>> ids = units.check(torch.tensor([4, 4, 7]), (torch.zeros(3, 2),), None, world_size=1)
    >>> units.commit(ids)
    >>> try:  # unit 7 again, in a second physical batch of the same step
    ...     units.check(torch.tensor([7]), (torch.zeros(1, 2),), None, world_size=1)
    ... except ConfigurationError:
    ...     print("refused")
    refused
    """

    def __init__(self) -> None:
        self._seen: set[int] = set()

    def check(
        self,
        units: object,
        batch: tuple[Any, ...],
        mask: torch.Tensor | None,
        *,
        world_size: int,
    ) -> set[int] | None:
        """Check ``units`` for one physical batch; returns its real units' ids (to
        :meth:`commit` once the batch is summed), or ``None`` without units."""
        import torch

        if units is None:
            return None
        if world_size > 1:
            raise ConfigurationError(
                f"accumulate(units=...) with {world_size} ranks: a unit's rows on two ranks "
                "would be clipped separately, and the sampler does not shard the batch by "
                "unit yet; train with privacy units in one process"
            )
        leaf = _batch_leaf(batch)
        rows = None if leaf is None else int(leaf.shape[0])
        problem = None
        if not isinstance(units, torch.Tensor):
            problem = f"got a {type(units).__name__}"
        elif units.dtype == torch.bool or units.is_floating_point() or units.is_complex():
            problem = f"got dtype {units.dtype}"
        elif units.dim() != 1 or (rows is not None and units.shape[0] != rows):
            problem = f"got shape {tuple(units.shape)} for a batch of {rows} rows"
        elif leaf is not None and units.device != leaf.device:
            problem = f"got it on {units.device}, the batch is on {leaf.device}"
        if problem is not None:
            raise ConfigurationError(
                f"accumulate(units=...): expected an integer tensor [B] on the batch's device "
                f"giving each row's privacy unit; {problem}"
            )
        assert isinstance(units, torch.Tensor)
        real = units if mask is None else units[mask.to(device=units.device, dtype=torch.bool)]
        ids = {int(i) for i in torch.unique(real).tolist()}
        again = sorted(ids & self._seen)
        if again:
            raise ConfigurationError(
                f"accumulate(units=...): unit(s) {again[:10]} already reached this logical step "
                "in an earlier physical batch; a unit's rows must be in one physical batch "
                "(each part would be clipped to C on its own). Put each unit in one batch, or "
                "call zero_grad() to drop the step"
            )
        return ids

    def commit(self, ids: set[int] | None) -> None:
        """Record a summed physical batch's units."""
        if ids:
            self._seen |= ids

    def reset(self) -> None:
        """A new logical step."""
        self._seen.clear()
