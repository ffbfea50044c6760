"""UnitPoissonSampler: Poisson sampling over privacy units, with a per-step record cap."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from opake.core.errors import ConfigurationError, InputTypeError
from opake.dpsgd.randomness import Randomness
from opake.dpsgd.sampling import UnitPoissonSampler, UnitSummary, unit_batch_rows

# 7 users with 1..7 records, interleaved (a unit's records are not adjacent)
USERS = [f"u{j}" for i in range(7) for j in range(i, 7)]


def _by_unit(sampler: UnitPoissonSampler, batch: list[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for record, unit in zip(batch, sampler.units_of(batch).tolist(), strict=True):
        groups.setdefault(unit, []).append(record)
    return groups


def test_grouping_summary_and_properties() -> None:
    sampler = UnitPoissonSampler(USERS, 0.25, seed=0)
    assert sampler.unit_count == sampler.dataset_size == 7
    assert sampler.record_count == len(USERS) == 28
    assert sampler.expected_batch_size == pytest.approx(7 * 0.25)
    assert sampler.accounting_kwargs == {"sample_rate": 0.25}
    assert len(sampler) == 4
    summary = sampler.summary()
    assert summary == UnitSummary(7, 28, 1, 4.0, 7, None, 0)
    capped = UnitPoissonSampler(USERS, 0.25, max_records_per_unit=3, seed=0).summary()
    assert capped.capped_units == 4
    assert "at most 3 per user per step (4 users above it)" in capped.describe("user")
    # units_of: dense ids in order of first appearance
    assert sampler.units_of([0, 1, 7, 27]).tolist() == [0, 1, 1, 6]


def test_every_drawn_unit_brings_all_its_records_grouped() -> None:
    sampler = UnitPoissonSampler(USERS, 0.5, seed=1)
    records_of: dict[int, list[int]] = {}
    for i, unit in enumerate(sampler.units_of(list(range(len(USERS)))).tolist()):
        records_of.setdefault(unit, []).append(i)
    for step in range(40):
        batch = sampler.batch_at(step)
        units = sampler.global_units(step).tolist()
        assert batch == [r for u in units for r in records_of[u]]
        ids = sampler.units_of(batch)
        assert (np.diff(ids) >= 0).all()  # grouped, units in increasing order


def test_unit_inclusion_is_bernoulli_q_and_independent() -> None:
    units, q, steps = 40, 0.2, 3000
    sampler = UnitPoissonSampler([u for u in range(units) for _ in range(2)], q, seed=7)
    joined = np.zeros((steps, units), dtype=bool)
    for step in range(steps):
        joined[step, sampler.global_units(step)] = True
    # each unit's count is Binomial(steps, q): 5-sd band
    sd = np.sqrt(steps * q * (1 - q))
    assert np.abs(joined.sum(0) - steps * q).max() < 5 * sd
    # batch sizes (in units) are Binomial(U, q)
    sizes = joined.sum(1)
    obs = np.bincount(sizes, minlength=units + 1)[:17]
    expected = stats.binom(units, q).pmf(np.arange(17)) * steps
    obs = np.append(obs, steps - obs.sum())
    expected = np.append(expected, steps - expected.sum())
    assert stats.chisquare(obs, expected).pvalue > 1e-3
    # two units join together at rate q²
    both = (joined[:, 0] & joined[:, 1]).sum()
    assert abs(both - steps * q * q) < 5 * np.sqrt(steps * q * q)


def test_the_cap_takes_a_uniform_subset_of_each_unit() -> None:
    # one unit of 6 records capped at 2 (each record kept w.p. 1/3 when the unit joins)
    units = ["big"] * 6 + ["a", "b", "b"]
    sampler = UnitPoissonSampler(units, 1.0, max_records_per_unit=2, seed=3)
    steps = 3000
    counts = np.zeros(len(units))
    pairs: set[tuple[int, ...]] = set()
    for step in range(steps):
        groups = _by_unit(sampler, sampler.batch_at(step))
        assert len(groups[0]) == 2  # exactly the cap
        assert groups[1] == [6]
        assert groups[2] == [7, 8]  # under the cap: all records
        pairs.add(tuple(groups[0]))
        counts[groups[0]] += 1
    assert len(pairs) == 15  # every 2-subset of 6 occurs
    sd = np.sqrt(steps * (1 / 3) * (2 / 3))
    assert np.abs(counts[:6] - steps / 3).max() < 5 * sd


def test_shards_split_units_never_records() -> None:
    world = 3
    key = Randomness.seeded(11)
    ranks = [
        UnitPoissonSampler(USERS, 0.6, randomness=key, rank=r, world_size=world)
        for r in range(world)
    ]
    whole = UnitPoissonSampler(USERS, 0.6, randomness=key)
    for step in range(30):
        shards = [r.batch_at(step) for r in ranks]
        assert sorted(r for s in shards for r in s) == sorted(whole.batch_at(step))
        seen = [set(whole.units_of(s).tolist()) for s in shards]
        for i in range(world):
            for j in range(i + 1, world):
                assert not seen[i] & seen[j]


def test_seeded_is_reproducible_secure_is_not_and_resume_is_exact() -> None:
    a = UnitPoissonSampler(USERS, 0.3, max_records_per_unit=2, seed=5)
    b = UnitPoissonSampler(USERS, 0.3, max_records_per_unit=2, seed=5)
    assert [a.batch_at(s) for s in range(20)] == [b.batch_at(s) for s in range(20)]
    secure = [UnitPoissonSampler(USERS, 0.3) for _ in range(2)]
    assert secure[0].secure
    assert [secure[0].batch_at(s) for s in range(30)] != [secure[1].batch_at(s) for s in range(30)]
    list(a)  # one epoch
    state = a.state_dict()
    resumed = UnitPoissonSampler(USERS, 0.3, max_records_per_unit=2, seed=0)
    resumed.load_state_dict(state)
    assert resumed.position == a.position == len(a)
    assert list(resumed) == list(a)


def test_resume_refuses_another_grouping_rate_or_cap() -> None:
    state = UnitPoissonSampler(USERS, 0.3, seed=5).state_dict()
    regrouped = list(reversed(USERS))
    for other in (
        UnitPoissonSampler(regrouped, 0.3, seed=5),
        UnitPoissonSampler(USERS, 0.4, seed=5),
        UnitPoissonSampler(USERS, 0.3, max_records_per_unit=3, seed=5),
    ):
        with pytest.raises(ConfigurationError, match="privacy accounting"):
            other.load_state_dict(state)


def test_bad_arguments_raise_typed_errors() -> None:
    with pytest.raises(InputTypeError, match="one unit key per record"):
        UnitPoissonSampler("abc", 0.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="there are none"):
        UnitPoissonSampler([], 0.5)
    with pytest.raises(InputTypeError, match="hashable"):
        UnitPoissonSampler([[1], [2]], 0.5)  # type: ignore[list-item]
    with pytest.raises(ConfigurationError, match="max_records_per_unit"):
        UnitPoissonSampler(USERS, 0.5, max_records_per_unit=0)
    with pytest.raises(ConfigurationError, match="sample_rate"):
        UnitPoissonSampler(USERS, 0.0)
    with pytest.raises(ConfigurationError, match="outside"):
        UnitPoissonSampler(USERS, 0.5, seed=0).units_of([28])
    # numpy and Python keys of the same value are one unit
    assert UnitPoissonSampler([np.int64(3), 3, 4], 0.5, seed=0).unit_count == 2


def test_unit_batch_rows_are_the_capped_poisson_moments():
    units = ["a"] * 5 + ["b"] * 1 + ["c"] * 3
    expected, largest = unit_batch_rows(units, 0.5, cap=2)
    assert expected == pytest.approx(0.5 * (2 + 1 + 2))
    assert largest == 5  # at most every unit's capped rows
    assert unit_batch_rows(units, 1.0, cap=None) == (9.0, 9)
