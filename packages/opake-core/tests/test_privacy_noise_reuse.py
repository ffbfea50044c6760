"""One secure key never releases the same noise twice (red-team review, round 7).

Every draw is a pure function of ``(key, "noise", index)`` and each noise generator counts its
own index from 0. Two generators on one ``Randomness.secure()`` — two optimizers given the same
``randomness=``, or a new optimizer loading an earlier state with the key of the old one —
released the same noise vector twice: the difference of the two updates is the clipped sum
with the noise cancelled. The source now reserves each index of its noise stream once."""

from __future__ import annotations

import copy

import pytest
import torch

from opake.core.errors import ConfigurationError, OperationError
from opake.dpsgd.noise import GaussianNoise
from opake.dpsgd.optimizer import DPOptimizer
from opake.dpsgd.randomness import Randomness


class _Sum(dict):
    max_norm = 1.0


def _optimizer(randomness=None):
    w = torch.nn.Parameter(torch.zeros(64))
    opt = DPOptimizer(
        torch.optim.SGD([w], lr=1.0),
        {"w": w},
        noise_multiplier=1.0,
        expected_batch_size=1.0,
        randomness=randomness,
    )
    return w, opt


def _noise_of_a_step(w, opt):
    """With a zero clipped sum, batch 1 and SGD, the step's gradient is its noise."""
    opt.accumulate(_Sum(w=torch.zeros(64)))
    opt.step()
    return w.grad.detach().clone()


def test_two_optimizers_on_one_secure_key_never_draw_the_same_noise():
    shared = Randomness.secure()
    w1, first = _optimizer(shared)
    released = [_noise_of_a_step(w1, first) for _ in range(3)]
    w2, second = _optimizer(shared)
    with pytest.raises(OperationError, match=r"already gave draws 0\.\.2 of stream 'noise'"):
        _noise_of_a_step(w2, second)
    assert all(float(r.abs().max()) > 0 for r in released)


def test_a_new_optimizer_loading_an_earlier_state_with_the_old_key_is_refused_before_restoring():
    shared = Randomness.secure()
    w1, first = _optimizer(shared)
    _noise_of_a_step(w1, first)
    earlier = copy.deepcopy(first.state_dict())  # after step 1
    for _ in range(2):
        _noise_of_a_step(w1, first)
    _, second = _optimizer(shared)
    with pytest.raises(ConfigurationError, match="without this randomness="):
        second.load_state_dict(earlier)
    # the advice works: a new optimizer with its own key continues from the earlier state
    w3, third = _optimizer()
    third.load_state_dict(earlier)
    assert torch.isfinite(_noise_of_a_step(w3, third)).all()


def test_a_deep_copy_shares_the_secure_key_and_its_reservations():
    noise = GaussianNoise(1.0)
    clone = copy.deepcopy(noise)
    assert clone.randomness is noise.randomness
    noise.add({"w": torch.zeros(4)}, sensitivity=1.0)
    with pytest.raises(OperationError, match="repeat values already released"):
        clone.add({"w": torch.zeros(4)}, sensitivity=1.0)


def test_a_seeded_source_replays_by_design():
    a, b = GaussianNoise(1.0, seed=3), GaussianNoise(1.0, seed=3)
    first = a.add({"w": torch.zeros(4)}, sensitivity=1.0)["w"]
    assert torch.equal(first, b.add({"w": torch.zeros(4)}, sensitivity=1.0)["w"])
    shared = Randomness.seeded(5)
    c, d = GaussianNoise(1.0, randomness=shared), GaussianNoise(1.0, randomness=shared)
    assert torch.equal(
        c.add({"w": torch.zeros(4)}, sensitivity=1.0)["w"],
        d.add({"w": torch.zeros(4)}, sensitivity=1.0)["w"],
    )
    assert copy.deepcopy(shared) == shared


def test_draw_rows_reserves_its_index_once_however_many_rows_are_read():
    noise = GaussianNoise(1.0)
    rows = noise.draw_rows({"w": (4, 3)}, 1.0)
    top, bottom = rows.rows("w", 0, 2), rows.rows("w", 2, 4)  # one draw, read in two parts
    assert top.shape == bottom.shape == (2, 3)
    assert noise.randomness.next_free("noise") == 1
    other = GaussianNoise(1.0, randomness=noise.randomness)
    with pytest.raises(OperationError):
        other.draw_rows({"w": (4, 3)}, 1.0)
