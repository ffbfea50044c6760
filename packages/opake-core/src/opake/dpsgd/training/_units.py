"""Privacy units passed to ``DPTraining.accumulate`` / ``step``: checked, and kept whole.

``DPTraining`` passes ``units=`` through to ``grad_fn`` (which clips each unit as a whole). What
it checks here is what ``grad_fn`` cannot see: a unit must not reach the step in two physical
batches (its two parts would be clipped separately: a sensitivity of 2C), nor on two ranks —
which nothing shards by unit yet, so ``units=`` is refused under ``torch.distributed``.
With ``DPTraining(privacy_units=...)`` the caller names each row's record instead
(``records=``) and :class:`RecordUnits` derives the units from the unit sampler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError

if TYPE_CHECKING:
    import torch

__all__ = ["RecordUnits", "StepUnits"]


def _tensor(units: object) -> torch.Tensor:
    import torch

    assert isinstance(units, torch.Tensor)
    return units


def _batch_leaf(batch: tuple[Any, ...]) -> torch.Tensor | None:
    import torch
    from torch.utils._pytree import tree_leaves

    leaves = [x for x in tree_leaves(batch) if isinstance(x, torch.Tensor) and x.dim() > 0]
    return leaves[0] if leaves else None


class StepUnits:
    """The units of the logical step in progress (each in one physical batch only).

    Given a unit sampler (``DPTraining(privacy_units=...)``), the rows' units come from it
    through ``records=`` (:class:`RecordUnits`) and ``units=`` is refused; otherwise ``units=``
    is the caller's and ``records=`` is refused.

    >>> import torch
    >>> units = StepUnits()
    >>> ids, rows = units.check(torch.tensor([4, 4, 7]), None, (torch.zeros(3, 2),), None,
    ...                         step=0, world_size=1)
    >>> units.commit(rows)
    >>> try:  # unit 7 again, in a second physical batch of the same step
    ...     units.check(torch.tensor([7]), None, (torch.zeros(1, 2),), None, step=0, world_size=1)
    ... except ConfigurationError:
    ...     print("refused")
    refused
    """

    def __init__(self, sampler: Any = None) -> None:
        self._seen: set[int] = set()
        self._used = False  # units= came with a physical batch of this step
        self._records = None if sampler is None else RecordUnits(sampler)

    def check(
        self,
        units: object,
        records: object,
        batch: tuple[Any, ...],
        mask: torch.Tensor | None,
        *,
        step: int,
        world_size: int,
    ) -> tuple[torch.Tensor | None, tuple[set[int] | None, object]]:
        """The rows' units for one physical batch (given, or from the unit sampler), checked;
        and what to :meth:`commit` once the batch is summed."""
        if self._records is None:
            if records is not None:
                raise ConfigurationError(
                    "accumulate(records=...) without privacy_units: records name the rows of a "
                    "unit-level batch; build DPTraining(privacy_units=...) for user-level DP"
                )
        elif units is not None:
            raise ConfigurationError(
                "accumulate(units=...) with privacy_units: the units come from the unit "
                "sampler; pass records=indices (the batch training.batches() yielded) instead"
            )
        elif records is None:
            raise ConfigurationError(
                "accumulate() without records=: with privacy_units, pass the record index of "
                "each row (the batch training.batches() yielded) so each unit is clipped as one"
            )
        else:
            units = self._records.units_for(records, batch, step=step)
        ids = self._ids(units, batch, mask, world_size=world_size)
        return units if units is None else _tensor(units), (ids, records)

    def _ids(
        self, units: object, batch: tuple[Any, ...], mask: torch.Tensor | None, *, world_size: int
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

    def check_complete(self, sampler: Any, step: int) -> None:
        """Before the noise: without ``privacy_units``, ``units=`` may only group the rows of
        one drawn example each (a DPO pair's two rows), so the step's units must be exactly as
        many as the examples the sampler drew for it. Grouping several examples into one unit
        clips them together — removing one of them could then move the sum by up to 2·C, which
        breaks the example-level guarantee (``privacy_units`` is the user-level way)."""
        if self._records is not None or not self._used:
            return
        from opake.dpsgd.sampling import PADDING_INDEX

        drawn = sum(1 for i in sampler.batch_at(step) if i != PADDING_INDEX)
        if len(self._seen) != drawn:
            raise ConfigurationError(
                f"units=: the {drawn} example(s) the sampler drew for this step arrived as "
                f"{len(self._seen)} unit(s). Without privacy_units, each unit must be the rows of "
                "exactly one drawn example (e.g. a DPO pair's two rows): grouping examples "
                "clips them together and breaks the per-example guarantee. Build "
                "DPTraining(privacy_units=...) for user-level DP; the step was dropped"
            )

    def commit(self, rows: tuple[set[int] | None, object]) -> None:
        """Record a summed physical batch's units (and records)."""
        ids, records = rows
        if ids is not None:
            self._seen |= ids
            self._used = True
        if self._records is not None:
            self._records.commit(records)

    def reset(self) -> None:
        """A new logical step."""
        self._seen.clear()
        self._used = False
        if self._records is not None:
            self._records.reset()


class RecordUnits:
    """``DPTraining(privacy_units=...)``: each physical batch names its records, and the units
    come from the sampler that drew them — never from the caller.

    A step's records must be rows of the batch the unit sampler drew for that step, each in one
    physical batch (several rows of one record — a DPO pair — are fine: they are in its unit):
    Poisson sampling over units is what the accountant's ε (per unit) is computed for, and a
    unit's gradient is bounded by C only if all of its rows in the step are clipped together.

    >>> from opake.dpsgd.sampling import UnitPoissonSampler
    >>> sampler = UnitPoissonSampler(["a", "b", "a", "c"], 1.0, seed=0)
    >>> import torch
    >>> RecordUnits(sampler).units_for([2, 0, 3], (torch.zeros(3, 1),), step=0).tolist()
    [0, 0, 2]
    """

    def __init__(self, sampler: Any) -> None:
        self._sampler = sampler
        self._seen: set[int] = set()
        self._drawn: tuple[int, frozenset[int]] | None = None  # (step, its drawn records)

    def _drawn_at(self, step: int) -> frozenset[int]:
        """The records the sampler drew for ``step``, computed once per logical step (every
        physical batch of the step checks against it)."""
        if self._drawn is None or self._drawn[0] != step:
            self._drawn = (step, frozenset(self._sampler.batch_at(step)))
        return self._drawn[1]

    def units_for(self, records: object, batch: tuple[Any, ...], *, step: int) -> torch.Tensor:
        """The unit of each row (int64, on the batch's device), after checking ``records``."""
        import numpy as np
        import torch

        leaf = _batch_leaf(batch)
        rows = None if leaf is None else int(leaf.shape[0])
        if isinstance(records, torch.Tensor):
            records = records.detach().cpu().tolist()
        try:
            index = np.asarray(records, dtype=np.int64).reshape(-1)
        except (TypeError, ValueError):
            raise InputTypeError(
                f"records={type(records).__name__}: expected the batch's record indices (the "
                "list training.batches() yielded, or the part of it this physical batch holds)"
            ) from None
        if rows is not None and index.size != rows:
            raise ConfigurationError(
                f"records= names {index.size} record(s) for a batch of {rows} rows: pass the "
                "index of every row, in row order"
            )
        drawn = self._drawn_at(step)
        listed = index.tolist()
        foreign = sorted(set(listed) - drawn)
        if foreign:
            raise ConfigurationError(
                f"records {foreign[:10]} are not in the batch the unit sampler drew for step "
                f"{step}: with privacy_units, every row must come from training.batches() (ε "
                "per unit holds for that sampling only)"
            )
        # a record may span several rows of one physical batch (a DPO pair's chosen and
        # rejected rows name the same record): they are in its unit, clipped together; a record
        # in two physical batches of the step would be counted twice
        repeated = sorted(set(listed) & self._seen)
        if repeated:
            raise ConfigurationError(
                f"records {repeated[:10]} appear twice in this logical step (in an earlier "
                "physical batch too): pass each drawn record in one physical batch"
            )
        units = torch.as_tensor(self._sampler.units_of(listed), dtype=torch.int64)
        return units if leaf is None else units.to(leaf.device)

    def commit(self, records: object) -> None:
        """Record a summed physical batch's records."""
        import numpy as np
        import torch

        if isinstance(records, torch.Tensor):
            records = records.detach().cpu().tolist()
        self._seen |= set(np.asarray(records, dtype=np.int64).reshape(-1).tolist())

    def reset(self) -> None:
        """A new logical step (or a restored sampler): the drawn records are recomputed."""
        self._seen.clear()
        self._drawn = None
