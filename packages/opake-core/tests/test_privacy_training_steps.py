"""Red-team round 8: what one logical step of ``DPTraining`` may release.

Each test failed on the earlier code: padding slots of a fixed-shape batch summed without a mask
(every slot loaded the last record), a step mixing a batch with ``units=`` and one without (one
example clipped twice), an optimizer that raised after updating the parameters (a released step
left out of the accountant), a budget stop that missed steps recorded into a shared accountant,
and σ calibrated without adaptive clipping's count noise.
"""

from __future__ import annotations

import pytest
import torch

from opake.accounting import make_accountant
from opake.core.errors import ConfigurationError
from opake.dpsgd.clipping import AdaptiveClipping
from opake.dpsgd.sampling import padding_mask
from opake.dpsgd.training import DPTraining, PrivacyBudgetExhausted
from opake.functional import make_functional


def _training(
    n: int, q: float, net: torch.nn.Linear | None = None, **options
) -> tuple[DPTraining, torch.nn.Linear]:
    """A DPTraining of a linear model (``net``, or a new one) with squared error, C = 1."""
    net = net if net is not None else torch.nn.Linear(3, 1, bias=False)
    fmodel, params = make_functional(net)

    def loss_fn(p, x, y):
        return (fmodel(p, x[None])[0, 0] - y) ** 2

    defaults = {"noise_multiplier": 1.0, "seed": 0, "engine": "vmap", "clipping_norm": 1.0}
    options = {**defaults, **options}
    opt = options.pop("optimizer", None) or torch.optim.SGD(net.parameters(), lr=0.0)
    training = DPTraining(
        loss_fn, opt, params, batch_args=2, dataset_size=n, sample_rate=q, delta=1e-5, **options
    )
    return training, net


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, generator=gen), torch.randn(n, generator=gen)


def test_fixed_shape_padding_summed_without_a_mask_is_refused_before_the_noise() -> None:
    n = 100
    x, y = _data(n)
    training, _ = _training(n, 0.1, sampler="fixed", steps=20)
    batches = training.batches()
    indices = next(batches)
    assert -1 in indices  # B_max slots, most of them padding
    rows = torch.tensor(indices)
    # X[-1] is the last record: summed once per padding slot without the mask
    with pytest.raises(ConfigurationError, match="padding"):
        training.step(x[rows], y[rows])
    assert training.steps == 0
    assert training.accountant.steps == 0
    # the documented call goes through; so does accumulating it in two physical batches
    training.step(x[rows], y[rows], example_mask=padding_mask(indices))
    indices = next(batches)
    rows, mask = torch.tensor(indices), padding_mask(indices)
    half = len(indices) // 2
    training.accumulate(x[rows[:half]], y[rows[:half]], example_mask=mask[:half])
    training.accumulate(x[rows[half:]], y[rows[half:]], example_mask=mask[half:])
    assert training.finish_step().batch_size == int(mask.sum())


def test_one_drawn_batch_accumulated_twice_is_refused() -> None:
    n = 50
    x, y = _data(n)
    training, _ = _training(n, 0.2)
    indices = next(training.batches())
    training.accumulate(x[indices], y[indices])
    training.accumulate(x[indices], y[indices])  # every drawn example a second time: 2·C
    with pytest.raises(ConfigurationError, match="drew"):
        training.finish_step()
    assert training.accountant.steps == 0


def test_a_step_cannot_mix_batches_with_and_without_units() -> None:
    training, _ = _training(2, 1.0)
    indices = next(training.batches())
    assert sorted(indices) == [0, 1]
    chosen = (torch.eye(3)[:2] * 100.0, torch.full((2,), -100.0))
    rejected = (torch.eye(3)[[0, 2]] * 100.0, torch.tensor([-100.0, 100.0]))
    training.accumulate(*chosen, units=torch.tensor([0, 1]), records=[0, 1])
    with pytest.raises(ConfigurationError, match="units="):
        training.accumulate(*rejected)  # the same examples' other rows, clipped on their own
    training.zero_grad()
    # and the other way round
    training.accumulate(*rejected)
    with pytest.raises(ConfigurationError, match="units="):
        training.accumulate(*chosen, units=torch.tensor([0, 1]), records=[0, 1])
    training.zero_grad()
    both = tuple(torch.cat([c, r]) for c, r in zip(chosen, rejected, strict=True))
    result = training.step(*both, units=torch.tensor([0, 1, 0, 1]), records=[0, 1, 0, 1])
    assert result.step == 1


def test_a_step_the_optimizer_applied_before_raising_is_accounted() -> None:
    n = 100
    x, y = _data(n)
    net = torch.nn.Linear(3, 1, bias=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    failures = {"left": 2}

    def post_hook(optimizer, args, kwargs) -> None:
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("failed after the update")

    opt.register_step_post_hook(post_hook)
    training, _ = _training(n, 0.1, net, optimizer=opt, seed=None)
    applied = 0
    batches = training.batches()
    for _ in range(4):
        indices = next(batches)
        before = net.weight.detach().clone()
        with pytest.raises(RuntimeError) if failures["left"] else _no_error():
            training.step(x[indices], y[indices])
        applied += not torch.equal(before, net.weight.detach())
    assert applied == 4
    assert training.accountant.steps == 4
    assert training.steps == 4


class _no_error:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


def test_the_budget_stops_at_the_target_of_a_shared_accountant() -> None:
    n = 100
    x, y = _data(n)
    shared = make_accountant("rdp")
    runs = [
        _training(n, 0.1, accountant=shared, target_epsilon=2.0, noise_multiplier=2.0)[0]
        for _ in range(2)
    ]
    feeds = [run.batches() for run in runs]
    taken = 0

    def take_turns() -> None:
        nonlocal taken
        for _ in range(200):
            for run, feed in zip(runs, feeds, strict=True):
                indices = next(feed)
                run.step(x[indices], y[indices])
                taken += 1
                assert run.epsilon() == pytest.approx(shared.get_epsilon(1e-5))

    with pytest.raises(PrivacyBudgetExhausted):
        take_turns()
    assert shared.get_epsilon(1e-5) <= 2.0
    assert taken == shared.steps
    assert runs[0].steps_left == runs[1].steps_left == 0


def test_sigma_calibrated_with_adaptive_clipping_counts_the_count_noise() -> None:
    clip = AdaptiveClipping(1.0, count_noise_multiplier=1.0, expected_batch_size=50.0)
    options = {"target_epsilon": 3.0, "steps": 40, "noise_multiplier": None, "seed": None}
    training, _ = _training(1000, 0.05, clipping_norm=clip, **options)
    assert training.steps_left == 40
