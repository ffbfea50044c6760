"""Red-team round 10: ``accumulate(records=...)`` on plain steps checks the rows themselves.

The step's count check (summed ≤ drawn) cannot see a loop that loads one drawn example twice in
place of another: as many rows as were drawn, and the repeated example moves the clipped sum by
2·C. With ``records=`` (each row's index from ``training.batches()``) every real row must be a
record drawn for the step, none summed twice, and every drawn record present by
``finish_step`` — checked against an exact oracle: whatever rows a loop passes, an accepted
step summed each drawn example exactly once.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opake.core.errors import ConfigurationError
from opake.dpsgd.sampling import padding_mask
from opake.dpsgd.training import DPTraining
from opake.functional import make_functional

N = 8


def _training(n: int = N, q: float = 1.0, **options: object) -> DPTraining:
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    fmodel, params = make_functional(net)

    def loss_fn(p, x, y):
        return (fmodel(p, x[None])[0, 0] - y) ** 2

    defaults: dict[str, object] = {"noise_multiplier": 1.0, "seed": 0, "clipping_norm": 1.0}
    return DPTraining(
        loss_fn,
        torch.optim.SGD(net.parameters(), lr=0.0),
        params,
        batch_args=2,
        dataset_size=n,
        sample_rate=q,
        delta=1e-3,
        **{**defaults, **options},
    )


def _data(n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, generator=gen) * 100.0, torch.randn(n, generator=gen) * 100.0


def _dropped(training: DPTraining) -> None:
    assert training.steps == 0
    assert training.accountant.steps == 0


def test_a_drawn_example_loaded_twice_in_place_of_another_is_refused() -> None:
    """The red team's loop: 8 drawn, rows [0, 0, 1, 2] and [3, 4, 5, 6] (record 7 left out):
    8 rows summed, so the count passes; ``records=`` names the repeat."""
    x, y = _data()
    training = _training()
    assert sorted(next(training.batches())) == list(range(N))
    rows = torch.tensor([0, 0, 1, 2])
    with pytest.raises(ConfigurationError, match=r"record\(s\) \[0\] name several rows"):
        training.accumulate(x[rows], y[rows], records=rows)
    _dropped(training)


def test_a_record_in_two_physical_batches_of_a_step_is_refused() -> None:
    x, y = _data()
    training = _training()
    next(training.batches())
    first, second = torch.tensor([0, 1, 2, 3]), torch.tensor([0, 4, 5, 6])
    training.accumulate(x[first], y[first], records=first)
    with pytest.raises(ConfigurationError, match="appear twice in this logical step"):
        training.accumulate(x[second], y[second], records=second)
    training.zero_grad()
    _dropped(training)


def test_a_step_missing_a_drawn_record_is_refused_before_the_noise() -> None:
    x, y = _data()
    training = _training()
    next(training.batches())
    first, second = torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 6])
    training.accumulate(x[first], y[first], records=first)
    training.accumulate(x[second], y[second], records=second)
    with pytest.raises(ConfigurationError, match="1 of the 8 example"):
        training.finish_step()
    _dropped(training)


def test_a_record_the_sampler_did_not_draw_is_refused() -> None:
    x, y = _data(50)
    training = _training(50, 0.1)
    drawn = next(training.batches())
    outside = next(i for i in range(50) if i not in drawn)
    rows = torch.tensor([*drawn[:-1], outside])
    with pytest.raises(ConfigurationError, match="not in the batch the sampler drew"):
        training.step(x[rows], y[rows], records=rows)
    _dropped(training)


def test_a_step_cannot_mix_batches_with_and_without_records() -> None:
    x, y = _data()
    training = _training()
    next(training.batches())
    first, second = torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 6, 7])
    training.accumulate(x[first], y[first], records=first)
    with pytest.raises(ConfigurationError, match="records= alone"):
        training.accumulate(x[second], y[second])  # unchecked rows beside checked ones
    training.zero_grad()
    training.accumulate(x[first], y[first])
    with pytest.raises(ConfigurationError, match="neither"):
        training.accumulate(x[second], y[second], records=second)
    training.zero_grad()
    _dropped(training)


def test_records_with_a_fixed_shape_mask_and_split_batches_match_the_plain_step() -> None:
    """The documented loop with ``records=indices`` releases what it does without them."""
    x, y = _data(40)
    sums = []
    for named in (False, True):
        training = _training(40, 0.1, sampler="fixed", steps=5)
        indices = next(training.batches())
        assert -1 in indices
        rows, mask = torch.tensor(indices), padding_mask(indices)
        half = len(indices) // 2
        for part in (slice(None, half), slice(half, None)):
            extra = {"records": rows[part]} if named else {}
            training.accumulate(x[rows[part]], y[rows[part]], example_mask=mask[part], **extra)
        sums.append({k: v.clone() for k, v in training.optimizer._sums.items()})
        assert training.finish_step().batch_size == int(mask.sum())
    for name, value in sums[0].items():
        torch.testing.assert_close(sums[1][name], value, rtol=0, atol=0)


def test_records_are_refused_under_several_ranks() -> None:
    from opake.dpsgd.training._listed import ListedRecords

    training = _training()
    next(training.batches())
    listed = ListedRecords(training.sampler)
    with pytest.raises(ConfigurationError, match="2 ranks"):
        listed.check([0], (torch.zeros(1, 3),), None, step=0, world_size=2)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.integers(min_value=0, max_value=N - 1), min_size=1, max_size=2 * N),
    cut=st.integers(min_value=0, max_value=2 * N),
)
def test_an_accepted_step_summed_every_drawn_example_once(rows: list[int], cut: int) -> None:
    """Whatever rows a loop passes with their records, in one or two physical batches: the
    step is refused, or each drawn example was summed exactly once (the exact oracle), and one
    example's contribution to the released sum is at most C."""
    x, y = _data()
    training = _training()
    assert sorted(next(training.batches())) == list(range(N))
    parts = [rows[:cut], rows[cut:]] if 0 < cut < len(rows) else [rows]
    try:
        for part in parts:
            index = torch.tensor(part)
            training.accumulate(x[index], y[index], records=index)
        training.finish_step()
    except ConfigurationError:
        _dropped(training)
        return
    assert sorted(rows) == list(range(N))
    # the oracle's bound: each example once, clipped to C, so the sensitivity is C
    assert math.isclose(training.steps, 1)


def test_a_loop_going_on_after_a_dropped_step_is_not_refused_for_ever() -> None:
    """After a dropped step the loop may take the next batch ``batches()`` hands out: the
    step's draw is then that batch (each a fresh draw no released step used). Before, every
    later step was checked against the dropped step's batch and refused."""
    x, y = _data(50)
    training = _training(50, 0.2)
    outcomes = []
    for k, indices in zip(range(5), training.batches(), strict=False):
        rows = torch.tensor(indices)
        kept = rows[:-1] if k == 1 else rows  # step 1 leaves a drawn record out: dropped
        try:
            training.step(x[kept], y[kept], records=kept)
            outcomes.append("released")
        except ConfigurationError:
            outcomes.append("dropped")
    assert outcomes == ["released", "dropped", "released", "released", "released"]
    assert training.steps == training.accountant.steps == 4
