"""Gradient canaries go through the real clipping, sampler slots and DP optimizer."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from opake.auditing import (
    CANARY_PARAMETER,
    GradientCanaries,
    random_token_canaries,
    step_quietly,
)
from opake.core.errors import ConfigurationError, OperationError


def test_directions_are_unit_vectors():
    dirac = GradientCanaries(5).directions()
    assert torch.equal(dirac, torch.eye(5))
    rand = GradientCanaries(5, kind="random", dimension=64, seed=0).directions()
    assert rand.shape == (5, 64)
    assert torch.allclose(rand.norm(dim=1), torch.ones(5))
    assert torch.equal(rand, GradientCanaries(5, kind="random", dimension=64, seed=0).directions())


def test_split_maps_slots_to_included_canaries_only():
    run = GradientCanaries(4).run([True, False, True, False], dataset_size=10, clipping_norm=1.0)
    assert run.total_size == 14
    real, ids = run.split([0, 9, 10, 11, 12, 13])
    assert real == [0, 9]
    assert ids == [0, 2]
    with pytest.raises(OperationError, match="beyond"):
        run.split([14])


@pytest.mark.parametrize("kind", ["dirac", "random"])
def test_clipped_sum_is_c_times_each_direction(kind):
    canaries = GradientCanaries(6, kind=kind, dimension=None if kind == "dirac" else 32, seed=1)
    run = canaries.run([True] * 6, dataset_size=3, clipping_norm=0.5)
    grads = run.clipped_sum([1, 4, 4])
    # reference: each canary's gradient (100·C·u) clipped to C, summed, one at a time
    u = canaries.directions().double()
    expected = sum(0.5 * u[i] for i in (1, 4, 4))
    assert grads.max_norm == 0.5
    assert torch.allclose(grads[CANARY_PARAMETER].double(), expected, atol=1e-6)
    empty = run.clipped_sum([])
    assert torch.count_nonzero(empty[CANARY_PARAMETER]) == 0


def test_scores_are_the_projections_of_the_noisy_sums():
    from opake.dpsgd.optimizer import DPOptimizer

    run = GradientCanaries(3).run([True, True, False], dataset_size=5, clipping_norm=1.0)
    opt = DPOptimizer(
        torch.optim.SGD([run.parameter], lr=1.0),
        run.params,
        noise_multiplier=0.5,
        expected_batch_size=4.0,
        seed=0,
    )
    sums = []
    for batch in ([5, 6], [6, 7], [0]):
        _, ids = run.split(batch)
        opt.accumulate(run.clipped_sum(ids))
        step_quietly(opt)
        sums.append(run.parameter.grad.double() * 4.0)
        run.observe(expected_batch_size=4.0)
    scores = run.scores([[5], [6, 7], []])
    assert np.allclose(scores["all_steps"], torch.stack(sums).sum(0).numpy())
    replayed = np.array([sums[0][0], sums[1][1], sums[1][2]])
    assert np.allclose(scores["replayed_steps"], replayed)
    # the log likelihood ratio of a Poisson-subsampled Gaussian, step by step (σ = 0.5, q = 0.2)
    lr = run.scores(noise_multiplier=0.5, sample_rate=0.2)["likelihood_ratio"]
    expected = [
        sum(math.log(0.8 + 0.2 * math.exp((float(s[i]) - 0.5) / 0.25)) for s in sums)
        for i in range(3)
    ]
    assert np.allclose(lr, expected)
    with pytest.raises(ConfigurationError, match="both"):
        run.scores(noise_multiplier=0.5)
    with pytest.raises(ConfigurationError, match="replay"):
        run.scores([[5]])


def test_observe_needs_the_parameter_in_the_optimizer():
    run = GradientCanaries(2).run([True, False], dataset_size=1, clipping_norm=1.0)
    with pytest.raises(OperationError, match=r"no \.grad"):
        run.observe(expected_batch_size=1.0)


def test_only_the_canary_zero_gradient_warning_is_silenced():
    from opake.core.errors import OpakePrivacyWarning
    from opake.dpsgd.optimizer import DPOptimizer

    unused = torch.nn.Parameter(torch.zeros(2))
    run = GradientCanaries(2).run([True, True], dataset_size=1, clipping_norm=1.0)
    params = {"unused": unused, **run.params}
    opt = DPOptimizer(
        torch.optim.SGD(list(params.values()), lr=1.0),
        params,
        noise_multiplier=1.0,
        expected_batch_size=1.0,
        seed=0,
    )
    opt.accumulate(run.clipped_sum([0]))  # the canary parameter gets a gradient, "unused" none
    with pytest.warns(OpakePrivacyWarning, match="unused"):
        step_quietly(opt)


def test_bad_canary_settings():
    with pytest.raises(ConfigurationError, match="kind"):
        GradientCanaries(3, kind="laser")
    with pytest.raises(ConfigurationError, match="dimension"):
        GradientCanaries(3, kind="dirac", dimension=9)
    with pytest.raises(ConfigurationError, match="entries"):
        GradientCanaries(3).run([True], dataset_size=1, clipping_norm=1.0)


def test_random_token_canaries():
    c = random_token_canaries(50, length=8, vocab_size=20, seed=0, low=4)
    assert c.examples.shape == (50, 8)
    assert c.examples.dtype == torch.long
    assert int(c.examples.min()) >= 4
    assert int(c.examples.max()) < 20
    picked = c.included_examples([True, False] * 25)
    assert torch.equal(picked, c.examples[::2])
    with pytest.raises(ConfigurationError):
        random_token_canaries(5, length=4, vocab_size=3, low=3)
