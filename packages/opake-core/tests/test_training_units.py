"""DPTraining(privacy_units=...): sampling, clipping and accounting by unit (user-level DP)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from opake import accounting
from opake.core.errors import ConfigurationError
from opake.core.testing import reference_clipped_grad, tiny_mlp
from opake.dpsgd.clipping import clipped_grad
from opake.dpsgd.noise import GaussianNoise
from opake.dpsgd.optimizer import DPOptimizer
from opake.dpsgd.sampling import UnitPoissonSampler
from opake.functional import make_functional

_spec = importlib.util.spec_from_file_location(
    "_training_helpers", Path(__file__).with_name("_training_helpers.py")
)
assert _spec is not None
assert _spec.loader is not None
T = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(T)

N, UNITS_EXPECTED, SIGMA, C, LR, DELTA, SEED = 48, 3.0, 1.1, 0.5, 0.2, 1e-5, 5
# 12 users with 3 to 6 records each (48 records), interleaved: a user's records are not adjacent
USERS = [f"user{(i * 5) % 12}" if i % 7 else f"user{i % 3}" for i in range(N)]
SETTINGS = {
    "dataset_size": N,
    "expected_batch_size": UNITS_EXPECTED,
    "noise_multiplier": SIGMA,
    "delta": DELTA,
    "clipping_norm": C,
    "seed": SEED,
    "privacy_units": USERS,
    "accountant": "rdp",
}


def _training(model=None, **options):
    return T.training({**SETTINGS, **options}, model, lr=LR)


def _unit_loop(start, x, y, records):
    """The obvious reference: per unit, sum its records' plain-autograd gradients, clip, sum."""
    fmodel = make_functional(tiny_mlp(seed=0))[0]
    units: dict[str, list[int]] = {}
    for r in records:
        units.setdefault(USERS[r], []).append(r)
    total = {n: torch.zeros_like(v, dtype=torch.float64) for n, v in start.items()}
    for rows in units.values():
        summed = reference_clipped_grad(
            T.loss(fmodel), (start, x[rows], y[rows]), clipping_norm=1e30, batch_argnums=(1, 2)
        )
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in summed.values()))
        factor = min(1.0, C / float(norm)) if float(norm) > 0 else 1.0
        for n, g in summed.items():
            total[n] += factor * g.double()
    return total


def test_a_step_samples_units_clips_each_unit_and_equals_a_hand_written_step():
    x, y = T.data(N)
    model, training = _training()
    assert training.privacy_unit == "unit"
    assert training.dataset_size == len(set(USERS)) == 12
    assert training.sample_rate == pytest.approx(UNITS_EXPECTED / 12)
    assert training.expected_batch_size == pytest.approx(UNITS_EXPECTED)
    indices = next(training.batches())
    sampler = UnitPoissonSampler(USERS, UNITS_EXPECTED / 12, seed=SEED)
    assert indices == sampler.batch_at(0)
    assert len({USERS[i] for i in indices}) >= 2  # several users, several records each
    start = T.params(model)
    result = training.step(x[indices], y[indices], records=indices)
    assert result.units == len({USERS[i] for i in indices})

    # hand-written: grad_fn(units=) + DPOptimizer with the unit sampler's rate, same seeds
    manual = tiny_mlp(seed=0)
    fmodel, params = make_functional(manual)
    grad_fn, state = clipped_grad(T.loss(fmodel), clipping_norm=C, batch_argnums=(1, 2))
    units = torch.as_tensor(sampler.units_of(indices))
    grads, _ = grad_fn(params, x[indices], y[indices], state=state, units=units)
    opt = DPOptimizer(
        torch.optim.SGD(manual.parameters(), lr=LR),
        manual,
        noise_multiplier=SIGMA,
        expected_batch_size=UNITS_EXPECTED,
        seed=SEED,
    )
    opt.accumulate(grads)
    opt.step()
    for name, value in T.params(manual).items():
        assert torch.equal(T.params(model)[name], value), name

    # the per-unit loop of plain autograd, one noise draw, / q·U, SGD
    total = _unit_loop(start, x, y, indices)
    noisy = GaussianNoise(SIGMA, seed=SEED).add(
        {n: v.float() for n, v in total.items()}, sensitivity=C
    )
    for name, value in start.items():
        expected = value - LR * noisy[name] / UNITS_EXPECTED
        torch.testing.assert_close(T.params(model)[name], expected, atol=2e-6, rtol=1e-5)


def test_epsilon_is_the_accountants_at_the_unit_rate():
    x, y = T.data(N)
    _, training = _training()
    for _, idx in zip(range(4), training.batches(), strict=False):
        training.step(x[idx], y[idx], records=idx)
    expected = accounting.epsilon(
        sample_rate=UNITS_EXPECTED / 12,
        noise_multiplier=SIGMA,
        steps=4,
        delta=DELTA,
        accountant="rdp",
    )
    assert training.epsilon() == pytest.approx(expected, rel=1e-12)


def test_the_cap_limits_each_units_records_per_step():
    _, training = _training(max_records_per_unit=2, expected_batch_size=6.0)
    counts = {u: USERS.count(u) for u in set(USERS)}
    assert max(counts.values()) > 2
    for _, idx in zip(range(20), training.batches(), strict=False):
        per_unit: dict[str, int] = {}
        for r in idx:
            per_unit[USERS[r]] = per_unit.get(USERS[r], 0) + 1
        assert all(c == min(2, counts[u]) for u, c in per_unit.items())


def test_a_unit_split_over_two_physical_batches_is_refused():
    x, y = T.data(N)
    _, training = _training(expected_batch_size=12.0)  # q = 1: every unit, every record
    idx = next(training.batches())
    first = [r for r in idx if USERS[r] == "user0"]
    assert len(first) > 1
    half, rest = first[:1], first[1:]
    training.accumulate(x[half], y[half], records=half)
    with pytest.raises(ConfigurationError, match="earlier physical batch"):
        training.accumulate(x[rest], y[rest], records=rest)
    training.zero_grad()
    # whole units in separate physical batches are fine
    others = [r for r in idx if USERS[r] != "user0"]
    training.logical_step(
        [
            {"args": (x[first], y[first]), "records": first},
            {"args": (x[others], y[others]), "records": torch.tensor(others)},
        ]
    )
    assert training.steps == 1


@pytest.mark.parametrize(
    ("call", "match"),
    [
        ({"units": "tensor"}, "pass records=indices"),
        ({}, "without records="),
        ({"records": "foreign"}, "not in the batch the unit sampler drew"),
        ({"records": "short"}, "for a batch of"),
    ],
)
def test_steps_need_the_drawn_records(call, match):
    x, y = T.data(N)
    _, training = _training(expected_batch_size=6.0)
    idx = next(training.batches())
    rows = idx
    kwargs = dict(call)
    if kwargs.get("units") == "tensor":
        kwargs["units"] = torch.zeros(len(idx), dtype=torch.int64)
    if kwargs.get("records") == "foreign":
        rows = [*idx[:-1], next(r for r in range(N) if r not in idx)]
        kwargs["records"] = rows
    if kwargs.get("records") == "short":
        kwargs["records"] = idx[:-1]
    with pytest.raises(ConfigurationError, match=match):
        training.step(x[rows], y[rows], **kwargs)
    assert training.steps == 0
    assert training.pending_batches == 0


def test_records_without_privacy_units_and_bad_settings_are_refused():
    x, y = T.data(N)
    _, plain = _training(privacy_units=None, expected_batch_size=8.0)
    # records= alone checks a plain step's rows against the draw: rows 0-2 are not step 0's
    with pytest.raises(ConfigurationError, match="the sampler drew"):
        plain.step(x[:3], y[:3], records=[0, 1, 2])
    for options, match in [
        ({"privacy_units": USERS[:-1]}, "47 entries for dataset_size=48"),
        ({"sampler": "fixed"}, "Poisson sampling only"),
        ({"privacy_units": None, "max_records_per_unit": 2}, "without privacy_units"),
        ({"expected_batch_size": 13.0}, "exceeds dataset_size=12"),
        ({"max_records_per_unit": 0}, "max_records_per_unit"),
    ]:
        with pytest.raises(ConfigurationError, match=match):
            _training(**options)


def test_resume_is_exact_and_refuses_a_regrouping():
    x, y = T.data(N)
    model_a, full = _training(max_records_per_unit=3)
    for _, idx in zip(range(5), full.batches(), strict=False):
        full.step(x[idx], y[idx], records=idx)

    model_b, first = _training(max_records_per_unit=3)
    for _, idx in zip(range(2), first.batches(), strict=False):
        first.step(x[idx], y[idx], records=idx)
    state = copy.deepcopy(first.state_dict())
    saved = T.params(model_b)

    model_c, second = _training(model=tiny_mlp(seed=5), max_records_per_unit=3)
    model_c.load_state_dict(saved)
    second.load_state_dict(state)
    for _, idx in zip(range(3), second.batches(), strict=False):
        second.step(x[idx], y[idx], records=idx)
    for name, value in T.params(model_a).items():
        assert torch.equal(T.params(model_c)[name], value), name
    assert second.epsilon() == full.epsilon()

    _, regrouped = _training(privacy_units=list(reversed(USERS)), max_records_per_unit=3)
    with pytest.raises(ConfigurationError):
        regrouped.load_state_dict(state)


def test_dp_optimizer_refuses_a_unit_sampler():
    model = tiny_mlp(seed=0)
    with pytest.raises(ConfigurationError, match="per privacy unit only if"):
        DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR),
            model,
            noise_multiplier=SIGMA,
            sampler=UnitPoissonSampler(USERS, 0.25, seed=0),
        )


def test_a_record_may_span_rows_of_one_batch_but_not_two_batches():
    """A DPO pair's two rows name one record: accepted within one physical batch (they are in
    the record's unit, clipped together); the record again in a later physical batch of the
    step is refused, and the step dropped (nothing noised or accounted)."""
    x, y = T.data(N)
    _, training = _training(expected_batch_size=6.0)
    idx = next(training.batches())
    rows = idx + idx  # every record twice, as a pair's chosen and rejected rows
    training.accumulate(x[rows], y[rows], records=rows)
    with pytest.raises(ConfigurationError, match="earlier physical batch"):
        training.accumulate(x[idx[:1]], y[idx[:1]], records=idx[:1])
    assert training.pending_batches == 0
    assert training.accountant.steps == 0
    training.accumulate(x[rows], y[rows], records=rows)  # the step again, as drawn
    training.finish_step()
    assert training.steps == 1


def test_the_drawn_batch_is_computed_once_per_logical_step(monkeypatch):
    """Every physical batch checks its records against the batch the unit sampler drew for the
    step: that batch is computed once per logical step, not once per physical batch."""
    x, y = T.data(N)
    _, training = _training(expected_batch_size=12.0)  # q = 1: every unit, every record
    sampler = training.sampler
    calls: list[int] = []
    batch_at = sampler.batch_at

    def counted(step):
        calls.append(step)
        return batch_at(step)

    monkeypatch.setattr(sampler, "batch_at", counted)
    for step in range(2):
        idx = next(training.batches())
        users = sorted({USERS[r] for r in idx})
        assert len(users) >= 4
        for user in users:  # one physical batch per unit
            rows = [r for r in idx if USERS[r] == user]
            training.accumulate(x[rows], y[rows], records=rows)
        training.finish_step()
        assert calls == list(range(step + 1))
    assert training.steps == 2
