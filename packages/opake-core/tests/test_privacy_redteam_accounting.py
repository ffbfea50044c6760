"""Regression tests of a red-team review of what the accountant is told.

1. ``DPOptimizer.sample_rate`` was settable on an optimizer built from a sampler: the
   accountant recorded the new q while the sampler kept drawing at its own (q = 0.1 drawn,
   0.001 accounted: ε = 0.61 reported for a true 7.90). A rate other than the sampler's is
   now refused, by the setter and by ``load_state_dict``.
2. ``AdaptiveClipping(seed=...)`` drew its count noise from that integer seed (stored in every
   checkpoint) in runs whose gradient noise was secure — required by the multi-rank path — so
   whoever held a checkpoint recovered each step's exact count from the clipping norms while
   the accountant credited the count noise. A seeded state is now refused with secure noise;
   unseeded, the count noise comes from the run's own random source (seeded runs replay it).
"""

from __future__ import annotations

import pytest
import torch

from opake.core.errors import ConfigurationError
from opake.dpsgd.clipping import AdaptiveClipping
from opake.dpsgd.optimizer import DPOptimizer
from opake.dpsgd.sampling import PoissonSampler
from opake.dpsgd.training import DPTraining
from opake.functional import make_functional

N, B = 50, 10


def _optimizer(rate: float) -> DPOptimizer:
    from opake.accounting import make_accountant

    w = torch.nn.Parameter(torch.zeros(3))
    return DPOptimizer(
        torch.optim.SGD([w], lr=0.1),
        {"w": w},
        noise_multiplier=1.0,
        sampler=PoissonSampler(1000, rate, seed=0),
        accountant=make_accountant("rdp"),
        delta=1e-5,
        seed=0,
    )


def test_a_sample_rate_other_than_the_samplers_is_refused():
    opt = _optimizer(0.1)
    with pytest.raises(ConfigurationError, match=r"draws every batch at q = 0\.1"):
        opt.sample_rate = 0.001
    opt.sample_rate = 0.1  # the sampler's own rate is accepted
    assert opt.sample_rate == 0.1


def test_a_checkpoint_with_another_rate_is_refused_by_a_sampler_bound_optimizer():
    other = _optimizer(0.2).state_dict()
    opt = _optimizer(0.1)
    with pytest.raises(ConfigurationError, match="checkpoint's sample_rate"):
        opt.load_state_dict(other)
    opt.load_state_dict(_optimizer(0.1).state_dict())


def _training(state: AdaptiveClipping, seed: int | None) -> tuple[DPTraining, torch.nn.Module]:
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    fmodel, params = make_functional(net)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (fmodel(p, x[None])[0, 0] - y) ** 2

    training = DPTraining(
        loss_fn,
        torch.optim.SGD(net.parameters(), lr=0.1),
        params,
        batch_args=2,
        dataset_size=N,
        expected_batch_size=B,
        noise_multiplier=1.0,
        delta=1e-5,
        clipping_norm=state,
        seed=seed,
    )
    return training, net


def _state(seed: int | None) -> AdaptiveClipping:
    return AdaptiveClipping(1.0, count_noise_multiplier=B / 20, expected_batch_size=B, seed=seed)


def test_a_seeded_count_noise_is_refused_in_a_secure_run():
    with pytest.raises(ConfigurationError, match="public seed"):
        _training(_state(123), seed=None)
    _training(_state(123), seed=7)  # a seeded, non-private run may seed its count noise too


def _bounds(seed: int | None) -> list[float]:
    training, _ = _training(_state(None), seed=seed)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 3, generator=gen) * 3, torch.randn(N, generator=gen)
    bounds = []
    for _, idx in zip(range(4), training.batches(), strict=False):
        training.step(x[idx], y[idx])
        bounds.append(training.clip_state.clipping_norm)
    return bounds


def test_the_count_noise_comes_from_the_runs_own_source():
    # seeded run: replayed exactly (the count noise is the run's stream "count")
    assert _bounds(seed=3) == _bounds(seed=3)
    assert _bounds(seed=3) != _bounds(seed=4)
    # secure run: a fresh key per run, so two runs differ
    assert _bounds(seed=None) != _bounds(seed=None)


def test_a_live_secure_noise_source_is_never_rewound():
    """3. Loading an earlier state into a live secure ``GaussianNoise`` kept its key and set the
    call index back: the next draws were noise already released (two outputs with the same
    noise cancel it). Refused now; a new object (a fresh key) loads any state."""
    from opake.dpsgd.noise import GaussianNoise

    noise = GaussianNoise(1.0)
    before = noise.state_dict()
    noise.add({"w": torch.zeros(4)}, 1.0)
    with pytest.raises(ConfigurationError, match="already released"):
        noise.load_state_dict(before)
    fresh = GaussianNoise(1.0)
    fresh.load_state_dict(before)
    ahead = GaussianNoise(1.0)
    ahead.load_state_dict(noise.state_dict())  # forward, or equal: continues the count
    assert ahead.calls == 1
    seeded = GaussianNoise(1.0, seed=0)
    state = seeded.state_dict()
    first = seeded.add({"w": torch.zeros(4)}, 1.0)["w"]
    seeded.load_state_dict(state)  # a seeded (not private) source replays on purpose
    assert torch.equal(seeded.add({"w": torch.zeros(4)}, 1.0)["w"], first)


def test_an_optimizer_whose_secure_noise_already_drew_refuses_an_earlier_state_untouched():
    from opake.accounting import make_accountant

    w = torch.nn.Parameter(torch.zeros(3))
    opt = DPOptimizer(
        torch.optim.SGD([w], lr=0.1),
        {"w": w},
        noise_multiplier=1.0,
        expected_batch_size=4.0,
        sample_rate=0.1,
        accountant=make_accountant("rdp"),
        delta=1e-5,
    )
    from opake.dpsgd.clipping import clipped_grad

    grad_fn, clip = clipped_grad(lambda p, x: (p["w"] * x).sum(), clipping_norm=1.0)
    before = opt.state_dict()
    grads, _ = grad_fn({"w": w.detach()}, torch.ones(2, 3), state=clip)
    opt.accumulate(grads)
    opt.step()
    after = opt.state_dict()
    with pytest.raises(ConfigurationError, match="released"):
        opt.load_state_dict(before)
    assert opt.state_dict()["steps"] == after["steps"]  # nothing was restored
