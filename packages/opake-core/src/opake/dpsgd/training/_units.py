"""Privacy units passed to ``DPTraining.accumulate`` / ``step``: checked, and kept whole.

``DPTraining`` passes ``units=`` through to ``grad_fn`` (which clips each unit as a whole). What
it checks here is what ``grad_fn`` cannot see: a unit must not reach the step in two physical
batches (its two parts would be clipped separately: a sensitivity of 2C), nor on two ranks —
which nothing shards by unit yet, so ``units=`` is refused under ``torch.distributed``.
With ``DPTraining(privacy_units=...)`` the caller names each row's record instead
(``records=``) and :class:`RecordUnits` derives the units from the unit sampler. Without it,
``units=`` comes with ``records=`` and :class:`ExampleUnits` checks that the step's units and
its drawn records correspond one to one (a unit is the rows of one drawn example).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError, OperationError

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.training._listed import ListedRecords

__all__ = ["ExampleUnits", "RecordUnits", "StepRecords", "StepUnits"]

#: how a step's physical batches name their rows, as the refusal of a mix says it
_MODES = {
    "units": "units= and records=",
    "records": "records= alone",
    "plain": "neither units= nor records=",
}


def _tensor(units: object) -> torch.Tensor:
    import torch

    assert isinstance(units, torch.Tensor)
    return units


def _batch_leaf(batch: tuple[Any, ...]) -> torch.Tensor | None:
    import torch
    from torch.utils._pytree import tree_leaves

    leaves = [x for x in tree_leaves(batch) if isinstance(x, torch.Tensor) and x.dim() > 0]
    return leaves[0] if leaves else None


def _record_list(records: object, rows: int | None) -> list[int]:
    """``records=`` as one int per row (a list, an array or a tensor), ``rows`` of them."""
    import numpy as np
    import torch

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
    listed: list[int] = index.tolist()
    return listed


def _kept_rows(mask: torch.Tensor | None, rows: int) -> list[bool]:
    """Which of ``rows`` rows are real (``example_mask`` True; all of them without a mask, or
    with a mask of another shape, which ``clipped_sum`` refuses)."""
    keep = [True] * rows if mask is None else mask.detach().cpu().reshape(-1).tolist()
    return keep if len(keep) == rows else [True] * rows


class StepUnits:
    """The units of the logical step in progress (each in one physical batch only).

    Given a unit sampler (``DPTraining(privacy_units=...)``), the rows' units come from it
    through ``records=`` (:class:`RecordUnits`) and ``units=`` is refused; otherwise ``units=``
    is the caller's and comes with ``records=`` (:class:`ExampleUnits`: each unit the rows of
    one drawn example, checked against ``sampler``, the training's).

    >>> import torch
    >>> from opake.dpsgd.sampling import PoissonSampler
    >>> sampler = PoissonSampler(10, 1.0, seed=0)  # every example drawn
    >>> units = StepUnits()
    >>> ids, rows = units.check(torch.tensor([4, 4, 7]), [0, 0, 1], (torch.zeros(3, 2),), None,
    ...                         step=0, world_size=1, sampler=sampler)
    >>> units.commit(rows)
    >>> try:  # unit 7 again, in a second physical batch of the same step
    ...     units.check(torch.tensor([7]), [2], (torch.zeros(1, 2),), None, step=0,
    ...                 world_size=1, sampler=sampler)
    ... except ConfigurationError:
    ...     print("refused")
    refused
    """

    def __init__(self, sampler: Any = None) -> None:
        self._seen: set[int] = set()
        # how this step's physical batches came (without privacy units): "units" (units= and
        # records=), "records" (records= alone, one row per drawn example) or "plain"
        self._mode: str | None = None
        self._records = None if sampler is None else RecordUnits(sampler)
        self._examples: ExampleUnits | None = None  # units= without privacy_units
        self._listed: ListedRecords | None = None  # records= alone (one row per example)

    def check(
        self,
        units: object,
        records: object,
        batch: tuple[Any, ...],
        mask: torch.Tensor | None,
        *,
        step: int,
        world_size: int,
        sampler: Any = None,
    ) -> tuple[torch.Tensor | None, tuple[set[int] | None, object]]:
        """The rows' units for one physical batch (given, or from the unit sampler), checked;
        and what to :meth:`commit` once the batch is summed. ``sampler``: the training's, the
        draw that ``records=`` must match when ``units=`` is given without privacy units."""
        if self._records is None:
            return self._example_units(units, records, batch, mask, (step, world_size, sampler))
        if units is not None:
            raise ConfigurationError(
                "accumulate(units=...) with privacy_units: the units come from the unit "
                "sampler; pass records=indices (the batch training.batches() yielded) instead"
            )
        if records is None:
            raise ConfigurationError(
                "accumulate() without records=: with privacy_units, pass the record index of "
                "each row (the batch training.batches() yielded) so each unit is clipped as one"
            )
        derived = self._records.units_for(records, batch, step=step)
        ids = self._ids(derived, batch, mask, world_size=world_size)
        return derived, (ids, records)

    def _example_units(
        self,
        units: object,
        records: object,
        batch: tuple[Any, ...],
        mask: torch.Tensor | None,
        where: tuple[int, int, Any],
    ) -> tuple[torch.Tensor | None, tuple[set[int] | None, object]]:
        """:meth:`check` without privacy units: ``units=`` and ``records=`` together, or
        neither; ``where``: ``(step, world_size, sampler)``."""
        step, world_size, sampler = where
        mode = "units" if units is not None else "records" if records is not None else "plain"
        if self._mode is not None and mode != self._mode:
            raise ConfigurationError(
                f"accumulate() with {_MODES[mode]} in a logical step whose earlier physical "
                f"batch came with {_MODES[self._mode]}: a step's batches all pass units= and "
                "records=, all records= alone, or none does (a drawn example's rows summed two "
                "ways could be clipped twice); the step was dropped"
            )
        if mode == "plain":
            return None, (None, None)
        if mode == "records":
            if sampler is None:
                raise OperationError("StepUnits.check(records=...) needs the training's sampler")
            if self._listed is None:
                from opake.dpsgd.training._listed import ListedRecords

                self._listed = ListedRecords(sampler)
            real = self._listed.check(records, batch, mask, step=step, world_size=world_size)
            return None, (None, real)
        ids = self._ids(units, batch, mask, world_size=world_size)
        if records is None:
            raise ConfigurationError(
                "accumulate(units=...) without records=: without privacy_units a unit must be "
                "the rows of exactly one drawn example (a DPO pair's two rows), which the step "
                "can only check knowing each row's record; pass records= (each row's index in "
                "the batch training.batches() yielded, a record's rows repeating it: "
                "records=indices * 2 for DPO's chosen-then-rejected rows)"
            )
        if self._examples is None:
            if sampler is None:
                raise OperationError("StepUnits.check(units=...) needs the training's sampler")
            self._examples = ExampleUnits(sampler)
        real = self._examples.check(_tensor(units), records, mask, step=step)
        return _tensor(units), (ids, real)

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
                "(each part would be clipped to C on its own); the step was dropped"
            )
        return ids

    def check_complete(self, sampler: Any, step: int) -> None:
        """Before the noise: without ``privacy_units``, the step's units (or its listed rows,
        ``records=`` alone) must be its drawn examples one to one
        (:meth:`ExampleUnits.check_complete`, :meth:`ListedRecords.check_complete`: each
        physical batch checked its records, the step checks that every drawn example came).
        ``sampler`` is the training's (the one each physical batch was checked against)."""
        if self._records is not None or self._mode not in ("units", "records"):
            return
        checker = self._examples if self._mode == "units" else self._listed
        if checker is None:  # the mode is set only by commit(), after check() built it
            raise OperationError("StepUnits.check_complete: no records were checked this step")
        checker.check_complete(step)

    def commit(self, rows: tuple[set[int] | None, object]) -> None:
        """Record a summed physical batch's units (and records)."""
        ids, records = rows
        if self._records is not None:
            if ids is not None:
                self._seen |= ids
            self._records.commit(records)
            return
        if ids is not None:
            self._seen |= ids
            self._mode = "units"
            if self._examples is not None and records is not None:
                self._examples.commit(records)
        elif records is not None and self._listed is not None:
            self._mode = "records"
            self._listed.commit(records)
        else:
            self._mode = "plain"

    def reset(self) -> None:
        """A new logical step."""
        self._seen.clear()
        self._mode = None
        for checker in (self._records, self._examples, self._listed):
            if checker is not None:
                checker.reset()


class RecordUnits:
    """``DPTraining(privacy_units=...)``: each physical batch names its records, and the units
    come from the sampler that drew them — never from the caller.

    A step's records must be rows of the batch the unit sampler drew for that step, each in one
    physical batch (several rows of one record — a DPO pair — are fine: they are in its unit):
    Poisson sampling over units is what the accountant's ε (per unit) is computed for, and a
    unit's gradient is bounded by C only if all of its rows in the step are clipped together.
    :class:`ExampleUnits` checks the records of ``units=`` (without privacy units) the same way
    (``by_unit=False``).

    >>> from opake.dpsgd.sampling import UnitPoissonSampler
    >>> sampler = UnitPoissonSampler(["a", "b", "a", "c"], 1.0, seed=0)
    >>> import torch
    >>> RecordUnits(sampler).units_for([2, 0, 3], (torch.zeros(3, 1),), step=0).tolist()
    [0, 0, 2]
    """

    def __init__(self, sampler: Any, *, by_unit: bool = True) -> None:
        self._sampler = sampler
        self._by_unit = by_unit
        self._seen: set[int] = set()
        self._drawn: tuple[int, frozenset[int]] | None = None  # (step, its drawn records)

    def drawn_at(self, step: int, listed: Sequence[int] = ()) -> frozenset[int]:
        """The records the sampler drew for ``step`` (padding slots are none), fixed by the
        step's first physical batch (``listed``, its records) and kept for the step.

        In a plain or prefetching loop that is the batch of ``step`` itself. After a dropped
        step the loop may go on with the next batch ``batches()`` hands out: the step's draw is
        then, among the batches handed out since ``step`` (at most
        :data:`~opake.dpsgd.training._drawn._RECENT`), the one the listed records are (a whole
        step in one physical batch), else the step's own or the newest that holds them all;
        each is a fresh draw no released step used."""
        from opake.dpsgd.sampling import PADDING_INDEX
        from opake.dpsgd.training._drawn import _RECENT

        if self._drawn is None or self._drawn[0] != step:

            def batch(at: int) -> frozenset[int]:
                return frozenset(self._sampler.batch_at(at)) - {PADDING_INDEX}

            last = max(int(getattr(self._sampler, "position", step + 1)), step + 1)
            newest = range(last - 1, max(step, last - _RECENT) - 1, -1)
            # the step's own batch first (a plain or prefetching loop), then the newest
            candidates = [batch(s) for s in (step, *(s for s in newest if s != step))]
            wanted = frozenset(listed)
            exact = [b for b in candidates if b == wanted]  # the whole draw in one batch
            holding = [b for b in candidates if wanted <= b] if wanted else []
            drawn = (exact or holding or candidates)[0]
            self._drawn = (step, drawn)
        return self._drawn[1]

    def check_records(self, listed: list[int], *, step: int) -> None:
        """Refuse records the sampler did not draw for ``step``, or that an earlier physical
        batch of the step already held."""
        foreign = sorted(set(listed) - self.drawn_at(step, listed))
        if foreign:
            why = (
                "with privacy_units, every row must come from training.batches() (ε per unit "
                "holds for that sampling only)"
                if self._by_unit
                else "every row must come from training.batches() (ε holds for that sampling "
                "only); mask padding slots out with example_mask"
            )
            raise ConfigurationError(
                f"records {foreign[:10]} are not in the batch the "
                f"{'unit ' if self._by_unit else ''}sampler drew for step {step}: {why}"
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

    def units_for(self, records: object, batch: tuple[Any, ...], *, step: int) -> torch.Tensor:
        """The unit of each row (int64, on the batch's device), after checking ``records``."""
        import torch

        leaf = _batch_leaf(batch)
        listed = _record_list(records, None if leaf is None else int(leaf.shape[0]))
        self.check_records(listed, step=step)
        units = torch.as_tensor(self._sampler.units_of(listed), dtype=torch.int64)
        return units if leaf is None else units.to(leaf.device)

    def missing(self, step: int) -> int:
        """How many of the records drawn for ``step`` no physical batch has held."""
        return len(self.drawn_at(step) - self._seen)

    def commit(self, records: object) -> None:
        """Record a summed physical batch's records."""
        self._seen |= set(_record_list(records, None))

    def reset(self) -> None:
        """A new logical step (or a restored sampler): the drawn records are recomputed."""
        self._seen.clear()
        self._drawn = None


class StepRecords:
    """The drawn records a step's physical batches named (checked as each batch comes, all of
    them wanted by :meth:`check_complete`); subclasses say what a missing record means."""

    def __init__(self, sampler: Any) -> None:
        self._records = RecordUnits(sampler, by_unit=False)

    #: why a step some drawn record did not reach is refused (``{missing}``, ``{drawn}``)
    MISSING = "{missing} of the {drawn} example(s) the sampler drew for this step never came"

    def check_complete(self, step: int) -> None:
        """Refuse a step that some drawn example did not reach (before the noise)."""
        missing = self._records.missing(step)
        if missing:
            drawn = len(self._records.drawn_at(step))
            raise ConfigurationError(self.MISSING.format(missing=missing, drawn=drawn))

    def commit(self, records: object) -> None:
        """Record a summed physical batch's real records."""
        self._records.commit(records)

    def reset(self) -> None:
        """A new logical step."""
        self._records.reset()


class ExampleUnits(StepRecords):
    """``units=`` without ``privacy_units``: the sampler drew examples, so each unit must be the
    rows of exactly one drawn example (a DPO pair's chosen and rejected rows), and each drawn
    example's rows exactly one unit — a bijection between the step's units and its drawn
    records, checked from ``records=`` (each row's record).

    A unit holding two examples clips them together, an example split over two units is
    clipped twice: either lets one example move the clipped sum by more than C (rows
    ``[A.c, B.c, A.r, B.r]`` with ``units=[0, 0, 1, 1]``: 4·C). A count of units cannot see
    that. Each physical batch pairs its real rows' units and records one to one, its records
    drawn and new to the step (:meth:`RecordUnits.check_records`); a unit in two physical
    batches is refused by :class:`StepUnits`; :meth:`check_complete` wants every drawn record.

    >>> import torch
    >>> from opake.dpsgd.sampling import PoissonSampler
    >>> examples = ExampleUnits(PoissonSampler(4, 1.0, seed=0))  # drawn: 0, 1, 2, 3
    >>> examples.check(torch.tensor([0, 1, 0, 1]), [2, 3, 2, 3], None, step=0)
    [2, 3]
    >>> try:  # one id per block, not per pair
    ...     examples.check(torch.tensor([0, 0, 1, 1]), [2, 3, 2, 3], None, step=0)
    ... except ConfigurationError:
    ...     print("refused")
    refused
    """

    def check(
        self, units: torch.Tensor, records: object, mask: torch.Tensor | None, *, step: int
    ) -> list[int]:
        """The real rows' records of one physical batch (to :meth:`commit`), after checking
        that they pair one to one with the rows' units (``units``: int ``[B]``, checked)."""
        rows = int(units.shape[0])
        listed = _record_list(records, rows)
        keep = _kept_rows(mask, rows)
        by_unit: dict[int, set[int]] = {}
        by_record: dict[int, set[int]] = {}
        for unit, record, kept in zip(units.detach().cpu().tolist(), listed, keep, strict=True):
            if kept:
                by_unit.setdefault(unit, set()).add(record)
                by_record.setdefault(record, set()).add(unit)
        real = list(by_record)
        self._records.check_records(real, step=step)
        mixed = sorted(u for u, held in by_unit.items() if len(held) > 1)
        if mixed:
            raise ConfigurationError(
                f"accumulate(units=..., records=...): unit(s) {mixed[:10]} hold the rows of "
                "several drawn examples. Without privacy_units a unit must be the rows of "
                "exactly one drawn example (a DPO pair's two rows): clipped together, one "
                "example can move the sum by up to 2·C. Give each example's rows an id of "
                "their own (one id per pair, e.g. cat([ids, ids]), not one per block), or build "
                "DPTraining(privacy_units=...) for user-level DP"
            )
        split = sum(1 for held in by_record.values() if len(held) > 1)
        if split:
            raise ConfigurationError(
                f"accumulate(units=..., records=...): {split} drawn example(s) have their rows "
                "split over several units; each part would be clipped to C on its own. Give "
                "all rows of one example (a DPO pair's chosen and rejected rows) the same unit"
            )
        return real

    MISSING = (
        "units=: {missing} of the {drawn} example(s) the sampler drew for this step reached no "
        "unit. Without privacy_units, every drawn example must be one unit (its rows named in "
        "records=), and every physical batch of a step that uses units= must pass units= and "
        "records=; the step was dropped"
    )
