"""Privacy units (``grad_fn(..., units=ids)``): each unit's summed gradient clipped as a whole.

Against the obvious oracle — a Python loop of plain autograd, each unit's per-example
gradients summed in fp64, clipped, summed — on both engines, a tied-embedding transformer
included; ``units=arange(B)`` is ``units=None`` bit for bit; chunks hold whole units; bad ids
raise; ``DPTraining`` passes units through and keeps each unit in one physical batch.
"""

from __future__ import annotations

import math

import pytest
import torch

from opake.core import testing
from opake.core.errors import ConfigurationError, InputTypeError
from opake.dpsgd.bookkeeping import BatchedLoss, causal_lm_losses
from opake.dpsgd.clipping import (
    AdaptiveClipping,
    AutoSClipping,
    GroupClipping,
    clipped_grad,
)
from opake.dpsgd.clipping._bookkeeping import BookkeepingEngine
from opake.dpsgd.clipping._units import UnitCall
from opake.dpsgd.clipping._vmap_engine import VmapEngine
from opake.dpsgd.training import DPTraining
from opake.dpsgd.training._units import StepUnits
from opake.functional import make_functional

F = torch.nn.functional
ENGINES = ("bookkeeping", "vmap")
# arbitrary, unsorted, non-contiguous ids; a unit's rows scattered over the batch
IDS = torch.tensor([7, -2, 7, 40, -2, 7, 3, 40, 11, 7])


def _mlp_loss(model):
    fmodel, params = make_functional(model)

    def losses(p, x, y):
        return F.cross_entropy(fmodel(p, x), y, reduction="none")

    return BatchedLoss(losses, fmodel), params


def unit_grads(per_example, ids, mask=None):
    """Each unit's gradient: its (real) rows' per-example gradients summed in fp64, in
    ascending id order (the order of ``ClipAux.unit_ids``)."""
    out = []
    for unit in torch.unique(ids).tolist():
        rows = [
            i for i in range(len(ids)) if int(ids[i]) == unit and (mask is None or bool(mask[i]))
        ]
        total = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in per_example[0].items()}
        for i in rows:
            for k, v in per_example[i].items():
                total[k] += v.double()
        out.append(total)
    return out


def _norms(grads):
    return [math.sqrt(sum(float(v.square().sum()) for v in g.values())) for g in grads]


def _call(loss, args, state, engine, ids, **options):
    grad_fn, state = clipped_grad(
        loss,
        clipping_norm=state,
        batch_argnums=(1, 2),
        return_aux=True,
        engine=engine,
        check_unused=False,
        **options,
    )
    kwargs = {} if ids is None else {"units": ids}
    (grads, aux), new_state = grad_fn(*args, state=state, **kwargs)
    assert grad_fn.engine == engine, grad_fn.engine_reason
    return grads, aux, new_state


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("microbatch_size", [None, 3, 1])
def test_equals_the_per_unit_loop(mlp, mlp_batch, engine, microbatch_size):
    loss, params = _mlp_loss(mlp)
    args = (params, *mlp_batch)
    one = loss.per_example(batch_argnums=(1, 2), has_aux=False)
    per_example, losses = testing.per_example_grads_loop(one, args, batch_argnums=(1, 2))
    units = unit_grads(per_example, IDS)
    ordered = sorted(_norms(units))
    clip = 0.5 * (ordered[2] + ordered[3])  # two of the five units clipped
    options = {"microbatch_size": microbatch_size, "normalize_by": 4.0}
    grads, aux, _ = _call(loss, args, clip, engine, IDS, **options)
    want = testing.reference_clipped_sum(units, clipping_norm=clip, normalize_by=4.0)
    testing.assert_grads_close(grads, want, rtol=1e-5)
    assert grads.max_norm == clip / 4.0  # C per unit: the sensitivity is unchanged
    assert aux.unit_ids.tolist() == [-2, 3, 7, 11, 40]
    assert int(aux.batch_size) == int(grads.batch_size) == 5
    torch.testing.assert_close(
        aux.grad_norms.double(), torch.tensor(_norms(units), dtype=torch.float64), rtol=1e-5, atol=0
    )
    # losses stay per row, in row order, whatever the chunks gathered
    torch.testing.assert_close(aux.loss_values, torch.stack(losses).float(), rtol=1e-6, atol=0)
    assert float(aux.clipping_rate) == pytest.approx(2 / 5)


@pytest.mark.parametrize(
    "state",
    [
        GroupClipping({"0": 0.5, "2": 1.0}),
        AutoSClipping(clipping_norm=1.0, stability=0.01),
        AdaptiveClipping(1.0, count_noise_multiplier=1.0, expected_batch_size=5, seed=0),
    ],
    ids=["group", "auto_s", "adaptive"],
)
def test_clip_states_clip_per_unit(mlp, mlp_batch, state):
    loss, params = _mlp_loss(mlp)
    args = (params, *mlp_batch)
    one = loss.per_example(batch_argnums=(1, 2), has_aux=False)
    per_example, _ = testing.per_example_grads_loop(one, args, batch_argnums=(1, 2))
    units = unit_grads(per_example, IDS)
    groups = {name: name.split(".")[0] for name in params}
    results = []
    for engine in ENGINES:
        grads, aux, new_state = _call(loss, args, state, engine, IDS, microbatch_size=4)
        want = testing.reference_clipped_sum(units, clipping_norm=state, groups=groups)
        testing.assert_grads_close(grads, want, rtol=1e-5)
        if isinstance(state, GroupClipping):
            assert all(v.shape == (5,) for v in aux.group_grad_norms.values())
        results.append(new_state)
    assert results[0] == results[1]
    if isinstance(state, AdaptiveClipping):  # the count counts units (b_u − ½ each)
        below = sum(n <= state.clipping_norm for n in _norms(units))
        # the noisy update of C reads the count: equal states mean equal counts; the count
        # itself is below − ½·units
        assert results[0].step == 1
        count = below - 0.5 * len(units)
        fresh = AdaptiveClipping(1.0, count_noise_multiplier=1.0, expected_batch_size=5, seed=0)
        fn, st = clipped_grad(
            loss, clipping_norm=fresh, batch_argnums=(1, 2), engine="vmap", check_unused=False
        )
        _, pending = fn(*args, state=st, units=IDS, end_step=False)
        assert float(pending.pending_count) == count


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("microbatch_size", [None, 3])
def test_one_row_per_unit_is_no_units_bit_for_bit(mlp, mlp_batch, engine, microbatch_size):
    loss, params = _mlp_loss(mlp)
    args = (params, *mlp_batch)
    options = {"microbatch_size": microbatch_size}
    plain, plain_aux, _ = _call(loss, args, 1.0, engine, None, **options)
    units, units_aux, _ = _call(loss, args, 1.0, engine, torch.arange(10), **options)
    assert all(torch.equal(plain[k], units[k]) for k in plain)
    assert torch.equal(plain_aux.grad_norms, units_aux.grad_norms)
    assert torch.equal(plain_aux.loss_values, units_aux.loss_values)
    assert plain_aux.unit_ids is None
    assert units_aux.unit_ids.tolist() == list(range(10))


@pytest.mark.parametrize("engine", ENGINES)
def test_padding_rows_and_nonfinite_units(mlp, mlp_batch, engine):
    loss, params = _mlp_loss(mlp)
    x, y = mlp_batch
    x = x.clone()
    x[3, 0] = float("nan")  # unit 40 is non-finite: it contributes zero
    x[9, 0] = float("inf")  # a padding row: left out of unit 7, whatever it holds
    mask = torch.ones(10, dtype=torch.bool)
    mask[[9, 1, 4]] = False  # unit -2 has no real row: not a unit of this batch
    grad_fn, state = clipped_grad(
        loss, clipping_norm=0.5, batch_argnums=(1, 2), return_aux=True, engine=engine
    )
    (grads, aux), _ = grad_fn(params, x, y, state=state, units=IDS, example_mask=mask)
    one = loss.per_example(batch_argnums=(1, 2), has_aux=False)
    per_example, _ = testing.per_example_grads_loop(one, (params, x, y), batch_argnums=(1, 2))
    units = unit_grads(per_example, IDS, mask)
    want = testing.reference_clipped_sum(units, clipping_norm=0.5)
    testing.assert_grads_close(grads, want, rtol=1e-5)
    assert int(aux.batch_size) == 4  # 3, 7, 11, 40
    assert int(aux.nonfinite_count) == 1
    assert all(bool(torch.isfinite(v).all()) for v in grads.values())


def _spy(monkeypatch, engine_cls, seen):
    original = engine_cls.chunk

    def chunk(self, args, m, units=None):
        seen.append(args[3].tolist())  # the row ids the chunk holds
        return original(self, args, m, units) if units is not None else original(self, args, m)

    monkeypatch.setattr(engine_cls, "chunk", chunk)


@pytest.mark.parametrize("engine", ENGINES)
def test_chunks_hold_whole_units(mlp, mlp_batch, engine, monkeypatch):
    model = mlp
    fmodel, params = make_functional(model)

    def losses(p, x, y, row):
        return F.cross_entropy(fmodel(p, x), y, reduction="none")

    loss = BatchedLoss(losses, fmodel)
    row = torch.arange(10)
    args = (params, *mlp_batch, row)
    whole, state = clipped_grad(loss, clipping_norm=0.5, batch_argnums=(1, 2, 3), engine=engine)
    want, _ = whole(*args, state=state, units=IDS)
    seen: list[list[int]] = []
    _spy(monkeypatch, BookkeepingEngine if engine == "bookkeeping" else VmapEngine, seen)
    grad_fn, state = clipped_grad(
        loss, clipping_norm=0.5, batch_argnums=(1, 2, 3), engine=engine, microbatch_size=3
    )
    got, _ = grad_fn(*args, state=state, units=IDS)
    for name in want:  # the same sum, up to the order of fp32 additions
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
    # unit 7 (4 rows) exceeds microbatch_size=3: its own chunk; the others packed whole
    assert sorted(map(sorted, seen)) == [[0, 2, 5, 9], [1, 4, 6], [3, 7, 8]]
    for rows in seen:
        ids = {int(IDS[r]) for r in rows}
        assert all(set(IDS.eq(u).nonzero().flatten().tolist()) <= set(rows) for u in ids)


def test_unit_plan():
    plan = UnitCall.plan(torch.tensor([5, 5, 5, 5, 1, 9, 9]), None, 2)
    assert plan.ids.tolist() == [1, 5, 9]
    assert plan.counts == (1, 4, 2)
    assert plan.ranges == ((0, 1), (1, 2), (2, 3))  # 4 rows > 2: alone; 1 + 4 > 2
    plan = UnitCall.plan(torch.tensor([2, 1, 2, 3]), None, 3)
    assert plan.ranges == ((0, 2), (2, 3))
    assert UnitCall.plan(torch.zeros(0, dtype=torch.int64), None, None).ranges == ()


def _lm():
    pytest.importorskip("transformers")
    model = testing.tiny_gpt2(n_embd=16, n_layer=1, n_head=2, vocab_size=64)
    fmodel, params = make_functional(model)

    def losses(p, ids, labels):
        return causal_lm_losses(fmodel(p, input_ids=ids, use_cache=False).logits, labels)

    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 64, (6, 8), generator=gen)
    labels = ids.clone()
    labels[1, 5:] = -100
    return BatchedLoss(losses, fmodel), params, ids, labels


@pytest.mark.parametrize("microbatch_size", [None, 2])
def test_transformer_with_tied_embedding_equals_the_per_unit_loop(microbatch_size):
    loss, params, ids, labels = _lm()
    units = torch.tensor([3, 1, 3, 2, 1, 3])  # unit 3 (3 rows) > microbatch 2: its own chunk
    one = loss.per_example(batch_argnums=(1, 2), has_aux=False)
    per_example, _ = testing.per_example_grads_loop(
        one, (params, ids, labels), batch_argnums=(1, 2)
    )
    grads = unit_grads(per_example, units)
    clip = sorted(_norms(grads))[1]
    want = testing.reference_clipped_sum(grads, clipping_norm=clip)
    got = {}
    for engine in ENGINES:
        got[engine], aux, _ = _call(
            loss, (params, ids, labels), clip, engine, units, microbatch_size=microbatch_size
        )
        testing.assert_grads_close(got[engine], want, rtol=1e-5)
        norms = torch.tensor(_norms(grads), dtype=torch.float64)
        torch.testing.assert_close(aux.grad_norms.double(), norms, rtol=1e-4, atol=0)
    testing.assert_grads_close(got["bookkeeping"], got["vmap"], rtol=1e-5)


@pytest.mark.parametrize(
    ("units", "error"),
    [
        (torch.tensor([0.0, 1.0, 2.0]), InputTypeError),
        (torch.tensor([True, False, True]), InputTypeError),
        (torch.tensor([0, 1]), InputTypeError),
        (torch.tensor([[0, 1, 2]]), InputTypeError),
        ([0, 1, 2], InputTypeError),
    ],
    ids=["float", "bool", "short", "2-d", "list"],
)
def test_bad_ids_raise(units, error):
    grad_fn, state = clipped_grad(lambda p, x: (p["w"] * x).sum(), clipping_norm=1.0)
    with pytest.raises(error, match="units"):
        grad_fn({"w": torch.zeros(2)}, torch.ones(3, 2), state=state, units=units)


def _training(mlp, seed=0):
    fmodel, params = make_functional(mlp)

    def loss_fn(p, x, y):
        return F.cross_entropy(fmodel(p, x[None]), y[None])

    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.1)
    return DPTraining(
        loss_fn,
        optimizer,
        params,
        batch_args=2,
        dataset_size=100,
        expected_batch_size=5,
        noise_multiplier=1.0,
        delta=1e-5,
        seed=seed,
        clipping_norm=0.5,
    )


def _pairs(training, step):
    """Step ``step``'s drawn examples, each as two rows of one unit (as a DPO pair is), and
    each row's record (``records=``)."""
    gen = torch.Generator().manual_seed(5)
    x_all, y_all = torch.randn(100, 8, generator=gen), torch.randint(0, 4, (100,), generator=gen)
    idx = training.sampler.batch_at(step)
    rows = [r for i in idx for r in (i, i)]
    units = torch.tensor([u for u in range(len(idx)) for _ in range(2)])
    return x_all[rows], y_all[rows], units, rows


def test_training_passes_units_through(mlp):
    training = _training(mlp)
    calls = []
    grad_fn = training._grad_fn

    def spy(*args, **kwargs):
        calls.append(kwargs.get("units"))
        return grad_fn(*args, **kwargs)

    training._grad_fn = spy
    x, y, units, records = _pairs(training, 0)
    drawn = len(units) // 2
    assert drawn >= 2
    result = training.step(x, y, units=units, records=records)
    assert calls[0] is units
    assert result.units == drawn
    assert result.batch_size == 2 * drawn
    assert 0.0 <= result.clipping_rate <= 1.0
    assert len(result.aux[0].grad_norms) == drawn
    # logical_step's dict form carries units too (each example's two rows in one batch)
    x, y, units, records = _pairs(training, 1)
    half = 2 * (len(units) // 4)
    result = training.logical_step(
        [
            {"args": (x[:half], y[:half]), "units": units[:half], "records": records[:half]},
            {"args": (x[half:], y[half:]), "units": units[half:], "records": records[half:]},
        ]
    )
    assert result.units == len(units) // 2


def test_training_refuses_a_unit_in_two_physical_batches(mlp):
    training = _training(mlp)
    x, y, units, records = _pairs(training, 0)
    # the second example's first row
    training.accumulate(x[:3], y[:3], units=units[:3], records=records[:3])
    with pytest.raises(ConfigurationError, match=r"unit\(s\) \[1\].*one physical batch"):
        training.accumulate(x[3:], y[3:], units=units[3:], records=records[3:])
    training.zero_grad()
    training.accumulate(x[:4], y[:4], units=units[:4], records=records[:4])
    training.accumulate(x[4:], y[4:], units=units[4:], records=records[4:])  # other units
    training.finish_step()


def test_training_refuses_units_that_group_drawn_examples(mlp):
    """Without privacy_units a unit may only hold one drawn example's rows: grouping two
    clips them together (removing one could move the sum by 2·C)."""
    training = _training(mlp)
    x, y, units, records = _pairs(training, 0)
    merged = units.clone()
    merged[merged == 1] = 0  # examples 0 and 1 as one unit
    with pytest.raises(ConfigurationError, match="rows of several drawn examples"):
        training.step(x, y, units=merged, records=records)
    assert training.steps == 0
    assert training.pending_batches == 0
    training.step(x, y, units=units, records=records)  # one unit per drawn example: fine
    assert training.steps == 1


@pytest.mark.parametrize(
    ("units", "match"),
    [
        (torch.tensor([0.5] * 10), "dtype torch.float32"),
        (torch.zeros(9, dtype=torch.int64), r"shape \(9,\) for a batch of 10"),
        (torch.zeros(10, dtype=torch.int64, device="meta"), "on meta"),
        ([0] * 10, "got a list"),
    ],
    ids=["float", "shape", "device", "list"],
)
def test_training_checks_units(mlp, mlp_batch, units, match):
    training = _training(mlp)
    with pytest.raises(ConfigurationError, match=match):
        training.step(*mlp_batch, units=units)
    assert training.steps == 0
    assert training.pending_batches == 0


def test_units_refused_across_ranks():
    with pytest.raises(ConfigurationError, match="2 ranks"):
        StepUnits().check(
            torch.zeros(3, dtype=torch.int64), None, (torch.zeros(3),), None, step=0, world_size=2
        )
