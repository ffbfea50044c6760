"""What the DP trainers sample: records, or privacy units; the fixed-shape sampler's slots.

With ``privacy_unit_column`` (the column naming each record's privacy unit — a user, a patient —
so that ε protects all of a unit's records together) the trainer reads the column from the raw
training dataset, samples units (``DPTraining(privacy_units=...)``), splits each logical batch
into physical batches at unit boundaries only (a unit's records clipped together must reach the
step in one physical batch) and names each physical batch's records (``records=``), so the units
come from the sampler.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from opake.core.errors import ConfigurationError

__all__ = [
    "split_units",
    "trainer_fixed_slots",
    "trainer_population",
    "trainer_unit_keys",
    "trainer_unit_rows",
    "unit_keys",
    "without_column",
]


def unit_keys(dataset: Any, column: str) -> list[Hashable]:
    """Each training record's unit, from ``column`` of a ``datasets.Dataset`` or of a sequence of
    mappings.

    >>> unit_keys([{"user": "a", "text": "x"}, {"user": "b", "text": "y"}], "user")
    ['a', 'b']
    """
    names = getattr(dataset, "column_names", None)
    if names is not None:
        if column not in names:
            raise ConfigurationError(
                f"privacy_unit_column={column!r}: the training dataset has no such column "
                f"(columns: {', '.join(map(str, names))}); name the column holding each "
                "record's unit (e.g. a user id)"
            )
        return list(dataset[column])
    keys: list[Hashable] = []
    for i in range(len(dataset)):
        record = dataset[i]
        if not isinstance(record, dict) or column not in record:
            raise ConfigurationError(
                f"privacy_unit_column={column!r}: training record {i} has no such field; every "
                "record must name its unit"
            )
        keys.append(record[column])
    return keys


def split_units(indices: Sequence[int], units: Sequence[int], chunks: int) -> list[list[int]]:
    """``chunks`` contiguous physical batches of a unit-level batch, cut at unit boundaries
    only (each cut at the boundary nearest its even share of rows; a physical batch may be
    empty). ``units``: each index's unit (a unit's records are adjacent, as the unit sampler
    yields them).

    >>> split_units([4, 5, 9, 1, 2, 3], [0, 0, 1, 2, 2, 2], 2)
    [[4, 5, 9], [1, 2, 3]]
    >>> split_units([4, 5, 9], [0, 0, 0], 2)
    [[4, 5, 9], []]
    """
    if len(indices) != len(units):
        raise ConfigurationError("split_units: one unit per index expected")
    starts = [i for i in range(1, len(units)) if units[i] != units[i - 1]]
    cuts: list[int] = []
    previous = 0
    for k in range(1, chunks):
        ideal = len(indices) * k / chunks
        candidates = [s for s in starts if s >= previous]
        cut = min(candidates, key=lambda s: (abs(s - ideal), s)) if candidates else len(indices)
        cut = max(cut, previous)
        cuts.append(cut)
        previous = cut
    bounds = [0, *cuts, len(indices)]
    return [list(indices[bounds[k] : bounds[k + 1]]) for k in range(chunks)]


def trainer_unit_keys(trainer: Any) -> list[Any] | None:
    """Each training record's privacy unit (``args.privacy_unit_column``), else ``None``;
    read once and kept on the trainer."""
    column = getattr(trainer.args, "privacy_unit_column", None)
    if column is None:
        return None
    if trainer._units is None:
        trainer._units = unit_keys(trainer.train_dataset, column)
    keys: list[Any] = trainer._units
    return keys


def trainer_population(trainer: Any) -> int:
    """What Poisson sampling draws from: the records, or the privacy units."""
    from opake.dpsgd.sampling import count_units

    keys = trainer_unit_keys(trainer)
    size: int = trainer._dataset_size() if keys is None else count_units(keys)
    return size


def trainer_unit_rows(trainer: Any) -> tuple[int, int] | None:
    """Expected and largest rows of a physical batch with privacy units, else ``None``."""
    keys = trainer_unit_keys(trainer)
    if keys is None:
        return None
    from opake.dpsgd.sampling import unit_batch_rows

    a = trainer.args
    expected, largest = unit_batch_rows(
        keys,
        trainer._expected_batch_size() / trainer_population(trainer),
        getattr(a, "max_records_per_unit", None),
    )
    # a physical batch is one of the chunks; the largest may be one unit alone, uncut
    chunks = int(a.gradient_accumulation_steps * a.world_size)
    return max(1, math.ceil(expected / chunks)), largest


def without_column(collate: Callable[[list[Any]], Any], column: str) -> Callable[[list[Any]], Any]:
    """*collate* on records without the unit column (the model does not take it).

    >>> without_column(lambda rows: rows, "user")([{"x": 1, "user": "a"}])
    [{'x': 1}]
    """

    def collate_records(rows: list[Any]) -> Any:  # Any: what *collate* returns
        return collate(
            [
                {k: v for k, v in r.items() if k != column} if isinstance(r, dict) else r
                for r in rows
            ]
        )

    return collate_records


def trainer_fixed_slots(trainer: Any, n: int, delta: float) -> int:
    """The fixed-shape sampler's slots: truncation charge ≤ δ/1000 at the target ε, rounded up
    to a multiple of the physical batches of all ranks (one static shape everywhere; more slots
    only lower the truncation probability)."""
    from opake.accounting import fixed_shape_slots

    a = trainer.args
    slots: int = fixed_shape_slots(
        dataset_size=n,
        sample_rate=trainer._expected_batch_size() / n,
        steps=trainer._planned_steps(),
        delta=delta,
        target_epsilon=a.target_epsilon,
        multiple_of=int(a.gradient_accumulation_steps * a.world_size),
    )
    return slots
