"""A resumed ``DPTraining`` refuses a saved state that does not agree with itself or with the
training, before anything is restored (red-team review, round 25): an accountant history
shorter than the optimizer's steps (ε under-reported), a file step that is not its optimizer's,
a σ hidden in the noise state, another divisor, an adaptive count-noise index already
released, a non-finite pending count."""

from __future__ import annotations

import copy
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from opake.core.errors import ConfigurationError, OperationError
from opake.dpsgd.checkpoint import CheckpointError
from opake.dpsgd.clipping import AdaptiveClipping, clip_state_from_dict, gradient_noise_multiplier

_spec = importlib.util.spec_from_file_location(
    "_training_helpers", Path(__file__).with_name("_training_helpers.py")
)
assert _spec is not None
assert _spec.loader is not None
T = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(T)

N, B, SIGMA, C, LR, DELTA = 64, 8.0, 1.3, 0.7, 0.2, 1e-5
SETTINGS = {
    "dataset_size": N,
    "expected_batch_size": B,
    "noise_multiplier": SIGMA,
    "delta": DELTA,
    "clipping_norm": C,
    "accountant": "rdp",
}


def _training(**options):
    return T.training({**SETTINGS, **options}, None, lr=LR)


def _adaptive(**options):
    clip = AdaptiveClipping(1.0, count_noise_multiplier=5.0, expected_batch_size=B)
    sigma = gradient_noise_multiplier(SIGMA, count_noise_multiplier=5.0)
    return _training(clipping_norm=clip, noise_multiplier=sigma, **options)


def _run(training, steps):
    x, y = T.data(N)
    for _, idx in zip(range(steps), training.batches(), strict=False):
        training.step(x[idx], y[idx])


def _snapshot(model, training):
    return (
        T.params(model),
        training.steps,
        training.accountant.steps,
        training.epsilon(),
        copy.deepcopy(training.optimizer.state_dict()["noise"]),
        training.sampler.state_dict(),
        training.clip_state.to_dict(),
    )


def _same(a, b):
    weights_a, *rest_a = a
    weights_b, *rest_b = b
    assert all(torch.equal(weights_a[n], weights_b[n]) for n in weights_a)
    assert rest_a == rest_b


def _edit_history(state, how):
    history = state["history"]
    if how == "one step":
        history[:] = [{**history[0], "num_steps": 1}]
    elif how == "empty":
        history.clear()
    elif how == "rate":  # a rate other than the training's: its steps are not this run's
        for phase in history:
            phase["sample_rate"] = 1e-6
    else:  # adaptive clipping's count noise dropped from the record
        for phase in history:
            phase["count_noise_multiplier"] = None


def _edits():
    return [
        ("accountant one step", lambda p: _edit_history(p["accountant"], "one step"), "records"),
        ("accountant empty", lambda p: _edit_history(p["accountant"], "empty"), "records"),
        ("count noise dropped", lambda p: _edit_history(p["accountant"], "count"), "records"),
        ("accountant rate", lambda p: _edit_history(p["accountant"], "rate"), "records"),
        ("noise σ", lambda p: p["optimizer"]["noise"].update(noise_multiplier=0.3), "0.3"),
        ("divisor", lambda p: p["optimizer"].update(expected_batch_size=1e30), "divides"),
        ("count index", lambda p: p["clip_state"].update(step=0), "count noise"),
        ("pending count", lambda p: p["clip_state"].update(pending_count=math.nan), "finite"),
    ]


def _load(training, state, path, model):
    if state is not None:
        training.load_state_dict(state)
    else:
        training.load(path, model=model)


@pytest.mark.parametrize("how", ["state_dict", "file"])
@pytest.mark.parametrize(("name", "edit", "match"), _edits(), ids=[e[0] for e in _edits()])
def test_an_inconsistent_saved_state_is_refused_before_anything_is_restored(
    tmp_path, how, name, edit, match
):
    model, training = _adaptive()  # secure: its key has given count noise 0..5
    _run(training, 6)
    state = path = None
    if how == "state_dict":
        state = copy.deepcopy(training.state_dict())
        edit(state)
    else:
        path = training.save(tmp_path / "run.pt", model=model)
        payload = torch.load(path, weights_only=True)
        parts = {k: v["state"] for k, v in payload["components"].items() if "state" in v}
        edit(parts)
        torch.save(payload, path)
    before = _snapshot(model, training)
    with pytest.raises((ConfigurationError, CheckpointError), match=match):
        _load(training, state if how == "state_dict" else None, path, model)
    _same(_snapshot(model, training), before)


def test_a_file_whose_step_is_not_its_optimizers_is_refused_before_restoring(tmp_path):
    model, training = _training()
    _run(training, 3)
    path = training.save(tmp_path / "run.pt", model=model)
    payload = torch.load(path, weights_only=True)
    payload["step"] = 9  # the header a caller (DPTrainer: global_step) compares first
    torch.save(payload, path)
    model_b, fresh = _training()
    _run(fresh, 1)
    before = _snapshot(model_b, fresh)
    with pytest.raises(ConfigurationError, match="records step 9 but 3 DP steps"):
        fresh.load(path, model=model_b)
    _same(_snapshot(model_b, fresh), before)


def test_the_unedited_states_still_resume(tmp_path):
    model, training = _adaptive()
    _run(training, 3)
    state, path = training.state_dict(), training.save(tmp_path / "run.pt", model=model)
    for load in ("state_dict", "file"):
        model_b, other = _adaptive()
        if load == "state_dict":
            other.load_state_dict(state)
        else:
            other.load(path, model=model_b)
        assert other.steps == other.clip_state.step == 3
        _run(other, 1)  # a new key: count noise index 3 is fresh for it
        assert other.steps == 4


def test_a_secure_count_noise_is_given_once_per_step():
    _, training = _adaptive()
    first = training.optimizer.count_noise(0)
    assert isinstance(first, float)
    with pytest.raises(OperationError, match="repeat values already released"):
        training.optimizer.count_noise(0)
    _, seeded = _adaptive(seed=3)  # reproducible, not private: replays by design
    assert seeded.optimizer.count_noise(0) == seeded.optimizer.count_noise(0)


def test_a_non_finite_pending_count_is_refused():
    state = AdaptiveClipping(1.0, count_noise_multiplier=5.0, expected_batch_size=B).to_dict()
    for value in (math.nan, math.inf, "3", True):
        with pytest.raises(ConfigurationError, match="pending_count"):
            clip_state_from_dict({**state, "pending_count": value})


def test_an_adaptive_run_whose_update_raised_once_still_resumes(tmp_path):
    # the step was noised and accounted, its clip state not moved (clip step < optimizer
    # steps): a legitimate file, once refused as "count noise would repeat"
    model, training = _adaptive()
    _run(training, 2)
    fail = {"left": 1}

    def hook(*_):
        if fail["left"]:
            fail["left"] -= 1
            raise RuntimeError("out of memory (simulated)")

    training.optimizer.optimizer.register_step_pre_hook(hook)
    with pytest.raises(RuntimeError, match="simulated"):
        _run(training, 1)
    _run(training, 2)
    assert training.optimizer.steps == 5
    assert training.clip_state.step == 4
    path = training.save(tmp_path / "run.pt", model=model)
    model_b, other = _adaptive()
    other.load(path, model=model_b)
    _run(other, 1)
    assert other.steps == 6


def test_a_damaged_per_rank_rng_entry_is_refused_before_restoring(tmp_path):
    model, training = _training()
    _run(training, 3)
    path = training.save(tmp_path / "run.pt", model=model)
    payload = torch.load(path, weights_only=True)
    payload["extra"]["opake.distributed"] = {  # load_checkpoint_distributed's per-rank states
        "world_size": 1,
        "rng": [
            {
                "torch": torch.zeros(5, dtype=torch.uint8),
                "python": [3, [0], None],
                "numpy": ["MT19937", torch.zeros(624, dtype=torch.int64), 0, 0, 0.0],
                "cuda": None,
            }
        ],
    }
    torch.save(payload, path)
    model_b, other = _training()
    _run(other, 1)
    before = _snapshot(model_b, other)
    with pytest.raises(CheckpointError, match="rng"):
        other.load(path, model=model_b)  # collective=True: load_checkpoint_distributed
    _same(_snapshot(model_b, other), before)


def test_a_rank_that_takes_a_count_index_refuses_to_draw_it_again():
    # ranks other than 0 receive the count noise from rank 0 and take its index all the same,
    # so every rank refuses a state that would draw it again
    from opake.dpsgd.optimizer._options import count_noise, reserve_count

    _, training = _adaptive()
    assert reserve_count(training.optimizer.noise, 3) == 0.0
    with pytest.raises(OperationError, match="repeat values already released"):
        count_noise(training.optimizer.noise, 2)
    assert isinstance(count_noise(training.optimizer.noise, 4), float)


@pytest.mark.parametrize("how", ["state_dict", "file"])
def test_a_restore_that_fails_in_torch_after_every_check_changes_nothing(tmp_path, how):
    # the wrapped torch optimizer's restore is the one step that can still fail after every
    # check passed: it goes first, so nothing (model, sampler, RNG, accountant) has changed
    model, training = _training()
    _run(training, 3)
    state, path = training.state_dict(), training.save(tmp_path / "run.pt", model=model)
    model_b, other = _training()
    _run(other, 1)

    def fail(*_):
        raise RuntimeError("the restore failed (simulated)")

    other.optimizer.optimizer.register_load_state_dict_pre_hook(fail)
    torch.manual_seed(5)
    before = (_snapshot(model_b, other), torch.get_rng_state())
    with pytest.raises((RuntimeError, CheckpointError), match="simulated"):
        _load(other, state if how == "state_dict" else None, path, model_b)
    _same(_snapshot(model_b, other), before[0])
    assert torch.equal(torch.get_rng_state(), before[1])
