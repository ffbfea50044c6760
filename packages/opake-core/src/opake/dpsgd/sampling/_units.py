"""Poisson sampling over privacy units (users, patients, authors), with a per-step record cap.

Implementation of :class:`~opake.dpsgd.sampling.UnitPoissonSampler`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from opake.core.errors import ConfigurationError, InputTypeError
from opake.dpsgd.randomness import Randomness
from opake.dpsgd.sampling._base import _BaseSampler, _int, _poisson_base, _rate

__all__ = ["UnitPoissonSampler", "UnitSummary", "count_units", "unit_batch_rows"]

#: 64-bit words per ChaCha20 block (keystream offsets are whole blocks)
_WORDS_PER_BLOCK = 8


@dataclass(frozen=True)
class UnitSummary:
    """How records are spread over units (what a run's plan shows).

    ``capped_units`` counts the units with more records than the cap (each step they are in,
    a uniformly random ``max_records_per_unit`` of their records is taken).
    """

    units: int
    records: int
    min_records: int
    median_records: float
    max_records: int
    max_records_per_unit: int | None
    capped_units: int

    def describe(self, unit: str = "unit") -> str:
        """One line for a plan, e.g. ``"12 users, 340 records (1/28.0/61 per user)"``.

        >>> UnitSummary(3, 7, 1, 2.0, 4, None, 0).describe("user")
        '3 users, 7 records (min/median/max per user: 1/2/4)'
        """
        cap = ""
        if self.max_records_per_unit is not None:
            cap = (
                f"; at most {self.max_records_per_unit} per {unit} per step "
                f"({self.capped_units} {unit}s above it)"
            )
        return (
            f"{self.units} {unit}s, {self.records} records (min/median/max per {unit}: "
            f"{self.min_records}/{self.median_records:g}/{self.max_records}){cap}"
        )


class UnitPoissonSampler(_BaseSampler):
    """Poisson sampling of privacy **units**: each unit joins each batch with probability q.

    Example-level DP protects one record; a person with many records is protected only by
    group privacy (ε grows with the number of records). This sampler draws *units* — every
    record carries its unit's key (a user id, a patient, an author) — independently with
    probability q per step, and a batch holds all records of the drawn units (at most
    ``max_records_per_unit`` of them, a uniformly random subset chosen with the sampler's
    randomness, when a cap is given). With the gradient of each unit clipped to C as one
    (``grad_fn(..., units=sampler.units_of(batch))``, ``DPTraining(privacy_units=...)``), the
    accountant's ε at rate q over the units is a guarantee **per unit**: adding or removing
    one unit with all its records.

    Batches are lists of record indices, grouped by unit (units in increasing order of their
    first record, each unit's records in increasing order). Ranks split the drawn *units*
    (``units[rank::world_size]``), never a unit's records. Empty batches are yielded.

    Args:
        units: the unit key of every record (length N, any hashable values: ids, names).
        sample_rate: q, the probability that a unit joins a batch (expected units per step ÷
            number of units).
        max_records_per_unit: at most this many records of one unit per step (``None``: all).
            The cap bounds a step's cost and a heavy user's weight in the update; privacy does
            not rest on it (the unit's clipped gradient is bounded by C whatever it holds).
        steps_per_epoch: batches per ``iter``; default ``round(1/q)``.
        seed: as :class:`PoissonSampler`: reproducible batches, **not private**.
        randomness: as :class:`PoissonSampler`.
        rank: as :class:`PoissonSampler` (ranks split the drawn units).
        world_size: as :class:`PoissonSampler`.

    Example:
        >>> sampler = UnitPoissonSampler(["ann", "bob", "ann", "cy", "bob", "ann"], 0.5, seed=0)
        >>> sampler.unit_count, sampler.expected_batch_size
        (3, 1.5)
        >>> batch = sampler.batch_at(0)
        >>> [int(u) for u in sampler.units_of(batch)] == sorted(sampler.units_of(batch).tolist())
        True
    """

    _kind = "unit_poisson"

    def __init__(
        self,
        units: Sequence[Hashable],
        sample_rate: float,
        *,
        max_records_per_unit: int | None = None,
        steps_per_epoch: int | None = None,
        seed: int | None = None,
        randomness: Randomness | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self._unit_of, self._order, self._starts = _group(units)
        self._q = _rate(sample_rate)
        self._cap = (
            None
            if max_records_per_unit is None
            else _int("max_records_per_unit", max_records_per_unit, minimum=1)
        )
        super().__init__(
            *_poisson_base(
                type(self).__name__,
                self._q,
                steps_per_epoch,
                (randomness, seed),
                (rank, world_size),
            )
        )

    @property
    def unit_count(self) -> int:
        """The number of units U (the accountant's dataset size)."""
        return int(self._starts.size - 1)

    @property
    def dataset_size(self) -> int:
        """The number of units (what Poisson sampling and the accountant count)."""
        return self.unit_count

    @property
    def record_count(self) -> int:
        """The number of records N."""
        return int(self._unit_of.size)

    @property
    def sample_rate(self) -> float:
        """The Poisson rate q of a unit (what the accountant needs)."""
        return self._q

    @property
    def max_records_per_unit(self) -> int | None:
        return self._cap

    @property
    def expected_batch_size(self) -> float:
        """q·U, the expected number of **units** per step: divide the noisy sum of clipped
        unit gradients by this."""
        return self._q * self.unit_count

    @property
    def accounting_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``accountant.step(...)``: Poisson at rate q over the units."""
        return {"sample_rate": self._q}

    def units_of(self, batch: Sequence[int]) -> np.ndarray:
        """The unit (``0 … U-1``, in order of first appearance in ``units``) of each record
        of ``batch``, as an int64 array: pass it as ``units=`` to the clipped-gradient call."""
        index = np.asarray(batch, dtype=np.int64).reshape(-1)
        if index.size and (index.min() < 0 or index.max() >= self.record_count):
            raise ConfigurationError(
                f"batch holds record indices outside 0…{self.record_count - 1}: pass a batch "
                "this sampler drew"
            )
        out: np.ndarray = self._unit_of[index]
        return out

    def summary(self) -> UnitSummary:
        """Units, records and records per unit (min/median/max), and how many units the cap
        cuts."""
        counts = np.diff(self._starts)
        capped = 0 if self._cap is None else int(np.count_nonzero(counts > self._cap))
        return UnitSummary(
            units=self.unit_count,
            records=self.record_count,
            min_records=int(counts.min()),
            median_records=float(np.median(counts)),
            max_records=int(counts.max()),
            max_records_per_unit=self._cap,
            capped_units=capped,
        )

    def global_units(self, step: int) -> np.ndarray:
        """Sorted units of the global batch of ``step`` (identical on every rank)."""
        step = _int("step", step, minimum=0)
        joined = self._source.bernoulli("poisson", step, self.unit_count, self._q)
        return np.flatnonzero(joined).astype(np.int64)

    def _records(self, step: int, units: np.ndarray) -> list[int]:
        """The records of ``units`` at ``step``: all of them, or a random ``cap`` of a unit
        with more (the smallest of its records' 64-bit keys at this step, drawn from the
        keystream at the records' positions in unit order, so each unit's choice is its own)."""
        out: list[int] = []
        for unit in units.tolist():
            start, stop = int(self._starts[unit]), int(self._starts[unit + 1])
            records = self._order[start:stop]
            if self._cap is not None and records.size > self._cap:
                skip = start % _WORDS_PER_BLOCK  # the keystream is read from block boundaries
                keys = self._source.uint64("cap", step, skip + records.size, offset=start - skip)
                keys = keys[skip:]
                chosen = np.argsort(keys, kind="stable")[: self._cap]
                records = np.sort(records[chosen])
            out.extend(records.tolist())
        return out

    def _batch(self, step: int) -> list[int]:
        units = self.global_units(step)[self._rank :: self._world_size]
        return self._records(step, units)

    def _config(self) -> dict[str, Any]:
        return {
            "units": self.unit_count,
            "records": self.record_count,
            "grouping": _fingerprint(self._unit_of),
            "sample_rate": self._q,
            "max_records_per_unit": self._cap,
            "steps_per_epoch": self._steps_per_epoch,
        }


def _group(units: Sequence[Hashable]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Dense unit ids per record (order of first appearance), the records sorted by unit
    (stable), and each unit's start in that order (``U + 1`` offsets)."""
    if isinstance(units, str | bytes) or not isinstance(units, Sequence | np.ndarray):
        raise InputTypeError(
            f"units={type(units).__name__}: expected a sequence with one unit key per record "
            "(e.g. a list of user ids)"
        )
    if len(units) == 0:
        raise ConfigurationError("units=[]: expected one unit key per record; there are none")
    ids: dict[Hashable, int] = {}
    try:
        dense = np.fromiter(
            (ids.setdefault(_key(key), len(ids)) for key in units), dtype=np.int64, count=len(units)
        )
    except TypeError as err:
        raise InputTypeError(f"units: every unit key must be hashable ({err})") from None
    order = np.argsort(dense, kind="stable").astype(np.int64)
    starts = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(np.bincount(dense, minlength=len(ids)), out=starts[1:])
    return dense, order, starts


def _key(key: Hashable) -> Hashable:
    """A unit key that compares by value: numpy scalars become the Python value (3 and
    np.int64(3) are one unit); keys that would hash by identity (tensors, arrays) or never equal
    themselves (NaN, a missing id) are refused — each would make its record a unit of its own."""
    if isinstance(key, np.generic):
        key = key.item()
    if isinstance(key, np.ndarray) or type(key).__module__.startswith("torch"):
        raise InputTypeError(
            f"units: a {type(key).__name__} unit key compares by identity, so every record would "
            "be its own unit; pass plain values (e.g. ids.tolist())"
        )
    if isinstance(key, float) and math.isnan(key):
        raise ConfigurationError(
            "units: a NaN unit key (a missing id?) never equals itself, so each such record "
            "would be its own unit; give every record its unit"
        )
    return key


def count_units(units: Sequence[Hashable]) -> int:
    """How many units *units* (one key per record) names, as :class:`UnitPoissonSampler`
    groups them.

    >>> count_units(["a", "b", "a", 3, 3.0])
    3
    """
    return int(_group(units)[2].size - 1)


def _fingerprint(dense: np.ndarray) -> str:
    """A digest of the grouping, so a resume with the records regrouped is refused."""
    import hashlib

    return hashlib.sha256(dense.astype("<i8").tobytes()).hexdigest()[:16]


def unit_batch_rows(
    units: Sequence[Hashable], sample_rate: float, cap: int | None = None
) -> tuple[float, int]:
    """The records of a unit-level Poisson batch: expected, and the largest a step is sized for
    (five standard deviations above, at most every unit's capped records).

    Unit ``u`` brings ``m_u = min(records of u, cap)`` records with probability q,
    independently: the batch has mean ``q·Σ m_u`` and variance ``q(1−q)·Σ m_u²`` records.

    >>> unit_batch_rows(["a"] * 4 + ["b"] * 2, 0.5)
    (3.0, 6)
    >>> unit_batch_rows(["a"] * 4 + ["b"] * 2, 0.5, cap=1)
    (1.0, 2)
    """
    _, _, starts = _group(units)
    sizes = [int(c) if cap is None else min(int(c), cap) for c in np.diff(starts)]
    expected = sample_rate * sum(sizes)
    spread = math.sqrt(sample_rate * (1.0 - sample_rate) * sum(m * m for m in sizes))
    return expected, max(1, min(sum(sizes), math.ceil(expected + 5.0 * spread)))
