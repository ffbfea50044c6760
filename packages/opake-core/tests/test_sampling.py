"""Tests for opake.dpsgd.sampling: Poisson statistics, empty batches, padding, shards, resume."""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from torch.utils.data import DataLoader, Dataset, TensorDataset

from opake.accounting import RDPAccountant, truncation_probability
from opake.core.errors import ConfigurationError, InputTypeError, OpakePrivacyWarning
from opake.dpsgd.sampling import (
    PADDING_INDEX,
    EmptyBatchCollate,
    FixedShapePoissonSampler,
    PaddedDataset,
    PoissonSampler,
    ShuffleSampler,
    padding_mask,
)


def _shuffle(*args: object, **kwargs: object) -> ShuffleSampler:
    with pytest.warns(OpakePrivacyWarning, match="not Poisson"):
        return ShuffleSampler(*args, **kwargs)  # type: ignore[arg-type]


# -- Poisson statistics ---------------------------------------------------------------------


def test_inclusion_frequency_matches_q() -> None:
    n, q, steps = 200, 0.1, 2000
    sampler = PoissonSampler(n, q, steps_per_epoch=steps, seed=11)
    counts = np.zeros(n)
    pair = 0
    sizes = []
    for batch in sampler:
        counts[batch] += 1
        pair += 0 in batch and 1 in batch
        sizes.append(len(batch))
    # Each example's count is Binomial(steps, q): sd = sqrt(steps·q(1-q)) ≈ 13.4. With 200
    # examples, a 6-sd band fails a correct sampler with probability < 200·2e-9.
    sd = math.sqrt(steps * q * (1 - q))
    assert np.max(np.abs(counts - steps * q)) < 6 * sd
    # Independence: a fixed pair is in a batch together with probability q².
    sd_pair = math.sqrt(steps * q * q * (1 - q * q))
    assert abs(pair - steps * q * q) < 6 * sd_pair
    # Batch sizes follow Binomial(N, q): chi-square goodness of fit over binned sizes.
    observed = Counter(sizes)
    edges = list(range(12, 30))  # bins: ≤12, 13, …, 29, ≥30
    obs = [sum(v for k, v in observed.items() if k <= 12)]
    obs += [observed.get(k, 0) for k in edges[1:]]
    obs += [sum(v for k, v in observed.items() if k >= 30)]
    dist = stats.binom(n, q)
    exp = [dist.cdf(12)] + [dist.pmf(k) for k in edges[1:]] + [dist.sf(29)]
    expected = np.array(exp) * steps
    assert stats.chisquare(obs, expected).pvalue > 1e-3


def test_global_batch_matches_bernoulli_reference_in_distribution() -> None:
    # The obvious reference draws one Bernoulli(q) per example; compare the mean and variance
    # of the batch size with Binomial(N, q) (fixed seed, 6-sd bands: mean sd = sqrt(v/steps),
    # sample variance sd ≈ v·sqrt(2/(steps-1))).
    n, q, steps = 1000, 0.03, 3000
    sampler = PoissonSampler(n, q, seed=5)
    sizes = np.array([sampler.global_batch(t).size for t in range(steps)])
    mean, var = n * q, n * q * (1 - q)
    assert abs(sizes.mean() - mean) < 6 * math.sqrt(var / steps)
    assert abs(sizes.var(ddof=1) - var) < 6 * var * math.sqrt(2 / (steps - 1))
    batch = sampler.global_batch(17)
    assert np.all(np.diff(batch) > 0)  # sorted, no duplicates
    assert batch.min() >= 0
    assert batch.max() < n


def test_defaults_and_properties() -> None:
    sampler = PoissonSampler(1000, 0.004, seed=1)
    assert len(sampler) == 250
    assert sampler.expected_batch_size == pytest.approx(4.0)
    assert sampler.accounting_kwargs == {"sample_rate": 0.004}
    assert sampler.dataset_size == 1000
    assert len(list(sampler)) == 250
    assert sampler.position == 250
    assert sampler.epoch == 1
    assert "PoissonSampler" in repr(sampler)


def test_seeded_reproducible_and_seed_sensitive() -> None:
    a = list(PoissonSampler(100, 0.1, seed=3))
    b = list(PoissonSampler(100, 0.1, seed=3))
    c = list(PoissonSampler(100, 0.1, seed=4))
    assert a == b
    assert a != c
    # the default is secure: no seed, nothing stored, two samplers draw different batches
    x, y = PoissonSampler(100, 0.3), PoissonSampler(100, 0.3)
    assert x.secure
    assert x.seed is None
    assert x.state_dict()["seed"] is None
    assert list(x) != list(y)


# -- empty batches end to end ---------------------------------------------------------------


def test_empty_batches_flow_through_a_dataloader() -> None:
    data = TensorDataset(torch.randn(20, 3), torch.arange(20))
    sampler = PoissonSampler(20, 0.02, steps_per_epoch=40, seed=0)
    expected_sizes = [sampler.global_batch(t).size for t in range(40)]
    assert 0 in expected_sizes
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=EmptyBatchCollate(data))
    sizes = []
    for x, y in loader:
        assert x.shape[1:] == (3,)
        assert x.dtype == torch.float32
        assert y.dtype == torch.int64
        assert x.shape[0] == y.shape[0]
        # A model and a sum over the batch work on empty batches too.
        assert (x @ torch.ones(3)).sum().item() == pytest.approx(float(x.sum()))
        sizes.append(x.shape[0])
    assert sizes == expected_sizes


class DictData(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, object]:
        return {"ids": torch.full((5,), i), "label": i, "text": f"row {i}"}


def test_empty_batch_of_dict_examples_keeps_structure() -> None:
    collate = EmptyBatchCollate(DictData())
    empty = collate([])
    assert empty["ids"].shape == (0, 5)
    assert empty["label"].shape == (0,)
    assert empty["text"] == []
    full = collate([DictData()[1], DictData()[2]])
    assert full["ids"].shape == (2, 5)
    custom = EmptyBatchCollate(DictData(), collate_fn=len)
    assert custom([DictData()[0]]) == 1
    with pytest.raises(InputTypeError):
        EmptyBatchCollate(DictData(), collate_fn=3)  # type: ignore[arg-type]
    with pytest.raises(InputTypeError):
        EmptyBatchCollate(object())


def test_empty_batches_with_worker_processes() -> None:
    data = TensorDataset(torch.randn(10, 2))
    sampler = PoissonSampler(10, 0.05, steps_per_epoch=12, seed=2)
    loader = DataLoader(
        data, batch_sampler=sampler, collate_fn=EmptyBatchCollate(data), num_workers=1
    )
    sizes = [x.shape[0] for (x,) in loader]
    assert sizes == [PoissonSampler(10, 0.05, seed=2).global_batch(t).size for t in range(12)]


# -- fixed shape ----------------------------------------------------------------------------


def test_fixed_shape_equals_poisson_when_not_truncated() -> None:
    n, q, b_max = 500, 0.02, 40
    fixed = FixedShapePoissonSampler(n, q, b_max, seed=9, steps_per_epoch=100)
    plain = PoissonSampler(n, q, seed=9, steps_per_epoch=100)
    for slots, batch in zip(fixed, plain, strict=True):
        assert len(slots) == b_max
        mask = padding_mask(slots)
        real = [i for i in slots if i != PADDING_INDEX]
        assert real == batch  # same draw, same order
        assert mask.tolist() == [True] * len(batch) + [False] * (b_max - len(batch))
    assert fixed.truncated_steps == 0
    assert fixed.accounting_kwargs == {"sample_rate": q, "max_batch_size": b_max,
                                       "dataset_size": n}  # fmt: skip


def test_truncation_keeps_a_subset_and_its_frequency_matches_the_binomial_tail() -> None:
    n, q, b_max, steps = 100, 0.1, 12, 3000
    fixed = FixedShapePoissonSampler(n, q, b_max, seed=4, steps_per_epoch=steps)
    plain = PoissonSampler(n, q, seed=4)
    for t, slots in enumerate(fixed):
        batch = plain.global_batch(t)
        real = [i for i in slots if i != PADDING_INDEX]
        assert len(real) == min(batch.size, b_max)
        assert set(real) <= set(batch.tolist())
    # The sampler truncates with P(Binomial(N, q) > B_max) ≈ 0.2; 6-sd binomial band.
    p = stats.binom.sf(b_max, n, q)
    sd = math.sqrt(steps * p * (1 - p))
    assert abs(fixed.truncated_steps - steps * p) < 6 * sd
    # The accountant charges the larger neighbour's tail, N + 1, which is ≥ p.
    assert fixed.truncation_probability == pytest.approx(stats.binom.sf(b_max, n + 1, q))
    assert fixed.truncation_probability >= p


def test_padded_dataset_gives_the_mask_through_a_dataloader() -> None:
    data = TensorDataset(torch.arange(30.0).unsqueeze(1) + 1.0)
    sampler = FixedShapePoissonSampler(30, 0.1, 8, seed=7, steps_per_epoch=15)
    reference = FixedShapePoissonSampler(30, 0.1, 8, seed=7, steps_per_epoch=15)
    loader = DataLoader(PaddedDataset(data), batch_sampler=sampler)
    for ((x,), mask), slots in zip(loader, reference, strict=True):
        assert x.shape == (8, 1)
        assert mask.dtype == torch.bool
        assert mask.tolist() == padding_mask(slots).tolist()
        # Real rows are the sampled examples; padded rows hold the filler (example 0 = 1.0).
        real = torch.tensor([i for i in slots if i != PADDING_INDEX], dtype=torch.float32)
        assert torch.equal(x[mask, 0], real + 1.0)
        assert torch.all(x[~mask, 0] == 1.0)
        # A masked sum only sees real examples.
        assert (x[:, 0] * mask).sum().item() == pytest.approx(float((real + 1.0).sum()))
    assert len(PaddedDataset(data)) == 30
    with pytest.raises(ConfigurationError):
        PaddedDataset(data)[-2]
    with pytest.raises(InputTypeError):
        PaddedDataset(3)


def test_fixed_shape_with_accountant() -> None:
    sampler = FixedShapePoissonSampler(10_000, 0.01, 170, seed=0)
    acc = RDPAccountant()
    acc.step(noise_multiplier=1.0, num_steps=1000, **sampler.accounting_kwargs)
    p = truncation_probability(dataset_size=10_000, sample_rate=0.01, max_batch_size=170)
    assert acc.truncation_mass == pytest.approx(1000 * p)
    assert sampler.truncation_probability == pytest.approx(p)


# -- rank sharding --------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 300),
    q=st.floats(0.01, 1.0),
    world=st.integers(1, 5),
    seed=st.integers(0, 2**32),
    step=st.integers(0, 10_000),
)
def test_rank_shards_partition_the_global_batch(
    n: int, q: float, world: int, seed: int, step: int
) -> None:
    ranks = [PoissonSampler(n, q, seed=seed, rank=r, world_size=world) for r in range(world)]
    for r in ranks:
        r.seek(step)
    shards = [next(iter(r)) for r in ranks]
    merged = sorted(i for shard in shards for i in shard)
    assert merged == ranks[0].global_batch(step).tolist()
    assert sum(len(s) for s in shards) == len(set(merged))  # disjoint
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


@settings(max_examples=20, deadline=None)
@given(world=st.integers(1, 4), per_rank=st.integers(1, 8), seed=st.integers(0, 2**32))
def test_fixed_shape_shards_have_static_shape_and_cover_the_slots(
    world: int, per_rank: int, seed: int
) -> None:
    b_max = world * per_rank
    n = 4 * b_max
    q = 0.2
    ranks = [
        FixedShapePoissonSampler(n, q, b_max, seed=seed, rank=r, world_size=world)
        for r in range(world)
    ]
    reference = FixedShapePoissonSampler(n, q, b_max, seed=seed)
    for step in range(3):
        shards = [r._batch(step) for r in ranks]
        assert all(len(s) == per_rank for s in shards)
        slots, _ = reference.global_slots(step)
        merged = sorted(i for s in shards for i in s if i != PADDING_INDEX)
        assert merged == sorted(i for i in slots.tolist() if i != PADDING_INDEX)


def test_shuffle_shards_and_epochs() -> None:
    ranks = [_shuffle(10, 4, drop_last=False, seed=1, rank=r, world_size=2) for r in range(2)]
    epoch = [sorted(a + b) for a, b in zip(*ranks, strict=True)]
    assert [len(b) for b in epoch] == [4, 4, 2]
    assert sorted(i for b in epoch for i in b) == list(range(10))  # each index exactly once
    second = [sorted(a + b) for a, b in zip(*ranks, strict=True)]
    assert second != epoch  # a fresh permutation each epoch
    assert sorted(i for b in second for i in b) == list(range(10))
    dropped = _shuffle(10, 4, seed=1)
    assert len(dropped) == 2
    assert dropped.batch_size == 4
    assert dropped.dataset_size == 10


# -- resume ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["poisson", "fixed", "shuffle"])
def test_state_dict_resume_continues_identically(kind: str) -> None:
    def make(seed: int) -> PoissonSampler | ShuffleSampler:
        if kind == "poisson":
            return PoissonSampler(60, 0.1, steps_per_epoch=5, seed=seed)
        if kind == "fixed":
            return FixedShapePoissonSampler(60, 0.1, 8, steps_per_epoch=5, seed=seed)
        return _shuffle(60, 7, seed=seed)

    full = make(13)
    reference = [b for _ in range(3) for b in full]  # three epochs, uninterrupted
    part = make(13)
    first = list(part)  # epoch 1 …
    it = iter(part)
    first += [next(it), next(it)]  # … and two batches of epoch 2, then stop
    k = len(first)
    assert first == reference[:k]
    state = json.loads(json.dumps(part.state_dict()))
    resumed = make(99)  # a different seed: the state restores the shared key
    resumed.load_state_dict(state)
    assert resumed.position == k
    rest = list(resumed)  # finishes the interrupted epoch …
    rest += list(resumed)  # … then continues with whole epochs
    assert first + rest == reference
    if kind == "fixed":
        assert resumed.truncated_steps == full.truncated_steps  # type: ignore[union-attr]
    sought = make(13)
    sought.seek(k)
    assert next(iter(sought)) == reference[k]


def test_load_state_dict_refuses_mismatches() -> None:
    sampler = PoissonSampler(60, 0.1, seed=1)
    state = sampler.state_dict()
    with pytest.raises(ConfigurationError, match="privacy accounting"):
        PoissonSampler(61, 0.1).load_state_dict(state)
    with pytest.raises(ConfigurationError, match="kind"):
        FixedShapePoissonSampler(60, 0.1, 12).load_state_dict(state)
    with pytest.raises(ConfigurationError, match="version"):
        PoissonSampler(60, 0.1).load_state_dict({**state, "version": 3})
    with pytest.raises(ConfigurationError, match="lacks"):
        PoissonSampler(60, 0.1).load_state_dict({"kind": "poisson"})
    with pytest.raises(InputTypeError):
        PoissonSampler(60, 0.1).load_state_dict([])  # type: ignore[arg-type]
    # A different rank / world size may resume the same global sequence.
    other = PoissonSampler(60, 0.1, seed=5, rank=1, world_size=2)
    other.load_state_dict(state)
    assert other.seed == 1


@pytest.mark.parametrize(
    "edit",
    [
        {"position": -1},
        {"position": True},
        {"seed": "x"},
        {"truncated_steps": -2},
        {"config": {"dataset_size": 61}},
    ],
)
def test_a_refused_state_changes_nothing_and_check_state_dict_says_so_first(edit) -> None:
    # a checkpoint loader checks every part before restoring any: check_state_dict refuses
    # exactly what load_state_dict refuses, and a refused load leaves the sampler as it was
    saved = FixedShapePoissonSampler(60, 0.1, 12, seed=1)
    for _ in zip(range(3), saved, strict=False):
        pass
    state = {**saved.state_dict(), **edit}
    live = FixedShapePoissonSampler(60, 0.1, 12, seed=2)
    next(iter(live))
    before = live.state_dict()
    with pytest.raises((ConfigurationError, InputTypeError)):
        live.check_state_dict(state)
    with pytest.raises((ConfigurationError, InputTypeError)):
        live.load_state_dict(state)
    assert live.state_dict() == before
    assert live.check_state_dict(saved.state_dict()) == 3


# -- bad input ------------------------------------------------------------------------------


def test_bad_arguments_raise_typed_errors() -> None:
    for q in (0.0, -0.5, 1.5):
        with pytest.raises(ConfigurationError, match="sample_rate"):
            PoissonSampler(10, q)
    with pytest.raises(InputTypeError, match="sample_rate"):
        PoissonSampler(10, "0.1")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="dataset_size"):
        PoissonSampler(0, 0.1)
    with pytest.raises(InputTypeError, match="dataset_size"):
        PoissonSampler(10.0, 0.1)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="rank"):
        PoissonSampler(10, 0.1, seed=0, rank=2, world_size=2)
    with pytest.raises(ConfigurationError, match="same seed"):
        PoissonSampler(10, 0.1, world_size=2)
    with pytest.raises(InputTypeError, match="seed"):
        PoissonSampler(10, 0.1, seed=-1)
    with pytest.raises(ConfigurationError, match="steps_per_epoch"):
        PoissonSampler(10, 0.1, steps_per_epoch=0)
    with pytest.raises(ConfigurationError, match="divisible"):
        FixedShapePoissonSampler(100, 0.1, 15, seed=0, world_size=2)
    with pytest.raises(ConfigurationError, match="expected batch size"):
        FixedShapePoissonSampler(100, 0.1, 5)
    with pytest.raises(ConfigurationError, match="batch_size"):
        ShuffleSampler(10, 11)
    with pytest.raises(InputTypeError, match="drop_last"):
        ShuffleSampler(10, 2, drop_last="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        PoissonSampler(10, 0.1, sed=3)  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match="position"):
        PoissonSampler(10, 0.1).seek(-1)


def test_shuffle_sampler_warns_at_construction() -> None:
    with pytest.warns(OpakePrivacyWarning, match="does not hold"):
        ShuffleSampler(10, 2, seed=0)


# -- batch_at: any step's batch, recomputed -------------------------------------------------


@pytest.mark.parametrize("kind", ["poisson", "fixed", "shuffle"])
def test_batch_at_is_what_iteration_yields_without_moving_the_position(kind: str) -> None:
    def make(rank: int) -> PoissonSampler | ShuffleSampler:
        shard: dict[str, Any] = {"seed": 4, "rank": rank, "world_size": 2}
        if kind == "poisson":
            return PoissonSampler(60, 0.3, steps_per_epoch=4, **shard)
        if kind == "fixed":
            # B_max barely above q·N: some steps are truncated
            return FixedShapePoissonSampler(60, 0.3, 20, steps_per_epoch=4, **shard)
        return _shuffle(60, 8, **shard)

    for rank in (0, 1):
        drawn = make(rank)
        yielded = [b for _ in range(3) for b in drawn]  # three epochs
        peek = make(rank)
        assert [peek.batch_at(step) for step in range(len(yielded))] == yielded
        assert peek.position == 0
        if kind == "fixed":
            assert drawn.truncated_steps > 0  # type: ignore[union-attr]
            assert peek.truncated_steps == 0  # type: ignore[union-attr]
    with pytest.raises(ConfigurationError, match="step"):
        make(0).batch_at(-1)


# -- a batch order that is not Poisson gets no ε ---------------------------------------------


def _not_poisson(which: str) -> object:
    from torch.utils.data import BatchSampler, RandomSampler

    if which == "ShuffleSampler":
        return _shuffle(64, 8, seed=0)
    return BatchSampler(RandomSampler(range(64)), batch_size=8, drop_last=False)


@pytest.mark.parametrize("which", ["ShuffleSampler", "BatchSampler"])
def test_dp_optimizer_refuses_a_batch_order_that_is_not_poisson_with_a_sample_rate(
    which: str,
) -> None:
    from opake.dpsgd.optimizer import DPOptimizer

    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ConfigurationError, match=r"not (describe )?Poisson sampling"):
        DPOptimizer(
            torch.optim.SGD([w], lr=0.1),
            {"w": w},
            noise_multiplier=1.0,
            sampler=_not_poisson(which),
            sample_rate=8 / 64,
            accountant=RDPAccountant(),
        )


@pytest.mark.parametrize("which", ["ShuffleSampler", "BatchSampler", "shuffle"])
@pytest.mark.parametrize("rate", [{"sample_rate": 0.125}, {"expected_batch_size": 8.0}, {}])
def test_dp_training_refuses_a_batch_order_that_is_not_poisson(
    which: str, rate: dict[str, Any]
) -> None:
    from opake.dpsgd.training import DPTraining

    w = torch.nn.Parameter(torch.zeros(2))
    sampler = which if which == "shuffle" else _not_poisson(which)
    with pytest.raises(ConfigurationError) as err:
        DPTraining(
            lambda p, x: (p["w"] * x).sum(),
            torch.optim.SGD([w], lr=0.1),
            {"w": w},
            dataset_size=64,
            noise_multiplier=1.0,
            delta=1e-5,
            sampler=sampler,  # type: ignore[arg-type]
            seed=0,
            **rate,
        )
    message = str(err.value)
    given = "'shuffle'" if which == "shuffle" else which
    assert message.startswith(f"sampler={given}")
    for name, value in rate.items():
        assert f"{name}={value!r}" in message
    assert "not Poisson sampling" in message
    assert "training.batches()" in message
    assert "\n" not in message
