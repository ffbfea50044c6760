"""Finding F4: ``DPTraining.step/accumulate(units=...)`` without ``privacy_units``.

A unit may only hold the rows of one drawn example (a DPO pair's chosen and rejected rows).
The guard used to be a count: as many distinct units as drawn examples. DPO rows of two drawn
pairs laid out ``[A.chosen, B.chosen, A.rejected, B.rejected]`` with ``units=[0, 0, 1, 1]`` (one
id per block instead of one per pair: ``repeat_interleave`` where ``cat`` was meant) give two
units for two examples and passed it; each unit then clipped two examples together and each
example was split over two units: with ``Linear(4, 1)`` (gradient = row) and C = 1, example A
moved the clipped sum by ‖Σ(with A) − Σ(without A)‖ = 4.000·C (measured, the bound is C).

Now the step is told each row's record (``records=``, the indices ``batches()`` yielded, a
record's rows repeating its index) and checks, over all physical batches of the logical step,
a bijection between the step's units and its drawn records, the records being exactly the
drawn batch; ``units=`` without ``records=`` is refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opake.core.errors import ConfigurationError
from opake.dpsgd.clipping import clipped_grad
from opake.dpsgd.optimizer import DPOptimizer
from opake.dpsgd.sampling import PADDING_INDEX, padding_mask
from opake.dpsgd.training import DPTraining
from opake.functional import make_functional

D, N, C, SIGMA, LR, SEED = 4, 20, 1.0, 1.0, 0.1, 0
E1 = torch.tensor([1.0, 0.0, 0.0, 0.0])
# each record: a chosen and a rejected row (the loss is the output: each row's gradient is the
# row itself), some far above C so that clipping bites
_GEN = torch.Generator().manual_seed(7)
CHOSEN = torch.randn(N, D, generator=_GEN) * 3.0
REJECTED = torch.randn(N, D, generator=_GEN) * 3.0


def _model() -> torch.nn.Module:
    model = torch.nn.Linear(D, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    return model


def _loss(fmodel):
    def loss_fn(p, x):  # one row: the gradient is x
        return fmodel(p, x[None])[0, 0]

    return loss_fn


def _training(expected_batch_size: float = 6.0, **options):
    model = _model()
    fmodel, params = make_functional(model)
    settings = {
        "dataset_size": N,
        "expected_batch_size": expected_batch_size,
        "noise_multiplier": SIGMA,
        "delta": 1e-5,
        "clipping_norm": C,
        "seed": SEED,
        **options,
    }
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    return model, DPTraining(_loss(fmodel), opt, params, module=model, **settings)


def _pairs(indices):
    """DPO's layout: the chosen rows, then the rejected rows; pair i's rows share unit i and
    name record ``indices[i]`` (``cat([ids, ids])``)."""
    idx = torch.as_tensor(indices, dtype=torch.long)
    rows = torch.cat([CHOSEN[idx], REJECTED[idx]])
    units = torch.cat([torch.arange(len(indices))] * 2)
    return rows, units, [*indices, *indices]


def _drawn(training, at_least: int = 3):
    indices = training.sampler.batch_at(training.steps)
    assert len(indices) >= at_least
    return indices


def _assert_dropped(training, steps: int = 0):
    assert training.steps == steps
    assert training.pending_batches == 0
    assert training.accountant.steps == steps


def test_the_block_layout_of_the_finding_is_refused():
    """The red-team reproducer: a step whose Poisson draw holds two examples A, B; rows
    ``[A.c, B.c, A.r, B.r]``, ``units=[0, 0, 1, 1]``. Before: accepted (2 units, 2 drawn), and
    A moved the clipped sum by 4·C. Now: refused without ``records=``, and with the true
    records (a unit spans two records, each record is split over two units)."""
    _, training = _training(expected_batch_size=2.0)
    for idx in training.batches():
        if len(idx) == 2:
            break
        training.step(torch.zeros(len(idx), D))  # ordinary steps, one row per example
    steps = training.steps
    a, b = idx
    u = E1
    rows = torch.stack([-10 * u, 5 * u, -10 * u, 5 * u])  # A.c, B.c, A.r, B.r
    blocks = torch.tensor([0, 0, 1, 1])
    # the magnitude the count check let through: one record moves the sum by 4·C
    fmodel, params = make_functional(_model())
    grad_fn, state = clipped_grad(_loss(fmodel), clipping_norm=C, batch_argnums=1)
    with_a, _ = grad_fn(params, rows, state=state, units=blocks)
    without_a, _ = grad_fn(params, rows[[1, 3]], state=state, units=torch.tensor([0, 1]))
    assert float((with_a["weight"] - without_a["weight"]).norm()) == pytest.approx(4.0 * C)

    with pytest.raises(ConfigurationError, match=r"records="):
        training.step(rows, units=blocks)
    _assert_dropped(training, steps)
    with pytest.raises(ConfigurationError, match=r"rows of several drawn examples"):
        training.step(rows, units=blocks, records=[a, b, a, b])
    _assert_dropped(training, steps)
    # one id per pair (cat, not repeat_interleave): accepted
    training.step(rows, units=torch.tensor([0, 1, 0, 1]), records=[a, b, a, b])
    assert training.steps == steps + 1


def test_the_dpo_layout_is_accepted_and_equals_a_hand_written_step():
    """``cat([ids, ids])`` with ``records=indices * 2``: the step is what it was before the
    check (``grad_fn(units=)`` + ``DPOptimizer``, same seeds, bitwise)."""
    model, training = _training()
    indices = _drawn(training)
    rows, units, records = _pairs(indices)
    result = training.step(rows, units=units, records=records)
    assert result.units == len(indices)
    assert result.batch_size == 2 * len(indices)  # rows

    manual = _model()
    fmodel, params = make_functional(manual)
    grad_fn, state = clipped_grad(_loss(fmodel), clipping_norm=C, batch_argnums=1)
    grads, _ = grad_fn(params, rows, state=state, units=units)
    opt = DPOptimizer(
        torch.optim.SGD(manual.parameters(), lr=LR),
        manual,
        noise_multiplier=SIGMA,
        expected_batch_size=6.0,
        seed=SEED,
    )
    opt.accumulate(grads)
    opt.step()
    assert torch.equal(model.weight, manual.weight)


def test_whole_pairs_over_several_physical_batches_and_any_record_type_are_accepted():
    _, training = _training()
    indices = _drawn(training)
    cut = len(indices) // 2
    items = []
    for part in (indices[:cut], indices[cut:]):
        rows, units, records = _pairs(part)
        items.append({"args": (rows,), "units": units + 100 * len(items), "records": records})
    items[1]["records"] = torch.as_tensor(items[1]["records"])
    result = training.logical_step(items)
    assert result.units == len(indices)
    indices = _drawn(training)
    rows, units, records = _pairs(indices)
    training.step(rows, units=units, records=np.asarray(records))
    assert training.steps == 2


def test_a_unit_spanning_two_records_is_refused():
    _, training = _training()
    indices = _drawn(training)
    rows, units, records = _pairs(indices)
    merged = units.clone()
    merged[merged == 1] = 0  # the first two pairs as one unit
    with pytest.raises(ConfigurationError, match=r"unit\(s\) \[0\] hold the rows of several"):
        training.step(rows, units=merged, records=records)
    _assert_dropped(training)
    # every row of the step one unit
    with pytest.raises(ConfigurationError, match="rows of several drawn examples"):
        training.step(rows, units=torch.zeros_like(units), records=records)
    _assert_dropped(training)


def test_a_record_split_over_two_units_is_refused():
    _, training = _training()
    indices = _drawn(training)
    rows, _, records = _pairs(indices)
    k = len(indices)
    apart = torch.cat([torch.arange(k), k + torch.arange(k)])  # chosen and rejected apart
    with pytest.raises(ConfigurationError, match=r"split over several units"):
        training.step(rows, units=apart, records=records)
    _assert_dropped(training)
    # the same split over two physical batches: the record seen again is refused
    training.accumulate(CHOSEN[indices], units=torch.arange(k), records=indices)
    with pytest.raises(ConfigurationError, match=r"earlier physical batch"):
        training.accumulate(REJECTED[indices], units=k + torch.arange(k), records=indices)
    training.zero_grad()
    _assert_dropped(training)


def test_records_must_be_the_drawn_batch():
    _, training = _training()
    indices = _drawn(training)
    rows, units, records = _pairs(indices)
    other = next(r for r in range(N) if r not in indices)
    foreign = [other if r == indices[0] else r for r in records]
    with pytest.raises(ConfigurationError, match="not in the batch the sampler drew"):
        training.step(rows, units=units, records=foreign)
    _assert_dropped(training)
    with pytest.raises(ConfigurationError, match=r"for a batch of"):
        training.step(rows, units=units, records=records[:-1])
    _assert_dropped(training)
    # a drawn example left out: refused before the noise, the step dropped
    rows, units, records = _pairs(indices[:-1])
    with pytest.raises(ConfigurationError, match=r"1 of the \d+ example\(s\) the sampler drew"):
        training.step(rows, units=units, records=records)
    _assert_dropped(training)
    # ... or passed without units in another physical batch of the step (refused as it comes)
    training.accumulate(rows, units=units, records=records)
    with pytest.raises(ConfigurationError, match=r"neither units= nor records= in a logical step"):
        training.accumulate(CHOSEN[indices[-1:]])
    training.zero_grad()
    _assert_dropped(training)
    # the same record in two physical batches (as two units)
    rows, units, records = _pairs(indices)
    training.accumulate(rows, units=units, records=records)
    with pytest.raises(ConfigurationError, match="earlier physical batch"):
        training.accumulate(CHOSEN[indices[:1]], units=torch.tensor([99]), records=indices[:1])
    training.zero_grad()
    _assert_dropped(training)


def test_units_without_records_and_records_without_units_are_refused():
    _, training = _training()
    indices = _drawn(training)
    rows, units, records = _pairs(indices)
    with pytest.raises(ConfigurationError, match=r"without records=.*pass records="):
        training.step(rows, units=units)
    _assert_dropped(training)
    with pytest.raises(ConfigurationError, match=r"name several rows"):
        training.step(rows, records=records)
    _assert_dropped(training)


def test_fixed_shape_padding_rows_are_masked_out_of_the_check():
    """Fixed shapes: padding slots (index ``PADDING_INDEX``, masked) are no drawn record;
    only the real rows must pair units and records one to one."""
    _, training = _training(sampler="fixed", max_batch_size=12)
    indices = training.sampler.batch_at(0)
    assert PADDING_INDEX in indices
    real = [i for i in indices if i != PADDING_INDEX]
    assert len(real) >= 2
    rows, units, records = _pairs([max(i, 0) for i in indices])
    records = [*indices, *indices]  # padding rows name PADDING_INDEX
    mask = padding_mask(indices)
    result = training.step(rows, units=units, records=records, example_mask=torch.cat([mask] * 2))
    assert result.units == len(real)
    # unmasked, the padding rows name no drawn record
    indices = training.sampler.batch_at(1)
    assert PADDING_INDEX in indices
    rows, units, _ = _pairs([max(i, 0) for i in indices])
    with pytest.raises(ConfigurationError, match="not in the batch the sampler drew"):
        training.step(rows, units=units, records=[*indices, *indices])
    _assert_dropped(training, 1)
