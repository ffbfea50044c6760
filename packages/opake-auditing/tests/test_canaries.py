"""Gradient canaries go through the run's clipping engine, sampler slots and DP optimizer; the
crafted ones fool a Gram norm computed as book-keeping computes it, and only that."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from opake.auditing import (
    CANARY_PARAMETER,
    CRAFTED_KINDS,
    GradientCanaries,
    random_token_canaries,
    step_quietly,
)
from opake.core.errors import ConfigurationError, OperationError


def test_directions_are_unit_vectors_and_dirac_ones_are_coordinates():
    canaries = GradientCanaries(8, seed=0)
    assert canaries.labels == ("dirac", *CRAFTED_KINDS) * 2
    rows, columns = canaries.shape
    u = canaries.directions()
    assert u.shape == (8, rows * columns)
    assert torch.allclose(u.double().norm(dim=1), torch.ones(8, dtype=torch.float64))
    dirac = GradientCanaries(5, crafted=False).directions()
    assert torch.equal(dirac.sum(dim=1), torch.ones(5))
    assert torch.equal(dirac @ dirac.T, torch.eye(5))  # one distinct coordinate each
    rand = GradientCanaries(5, kind="random", crafted=False, seed=0).directions()
    assert torch.equal(rand, GradientCanaries(5, kind="random", crafted=False, seed=0).directions())
    assert (rand @ rand.T - torch.eye(5)).abs().max() < 0.1  # nearly orthogonal


def test_every_example_has_the_promised_gradient_and_direction():
    canaries = GradientCanaries(8, kind="random", seed=0)
    x, y = canaries.examples(range(8), clipping_norm=0.5)
    assert x.dtype == y.dtype == torch.float32
    gradient = torch.einsum("ntr,ntk->nrk", y.double(), x.double()).flatten(1)  # exact in fp64
    assert torch.allclose(gradient.norm(dim=1), torch.full((8,), 50.0, dtype=torch.float64))
    along = (gradient * canaries.directions().double()).sum(dim=1)
    assert torch.allclose(along, torch.full((8,), 50.0, dtype=torch.float64))


def _padded(canaries, ids):
    from opake.auditing._crafted import batch_rows

    x, y = canaries.examples(ids, clipping_norm=1.0)
    rows, _ = batch_rows(len(ids), canaries.shape[1])
    pad = rows - len(ids)
    return torch.cat([x, x.new_zeros(pad, *x.shape[1:])]), torch.cat(
        [y, y.new_zeros(pad, *y.shape[1:])]
    )


def test_crafted_canaries_have_a_zero_gram_norm_where_book_keeping_computes_it():
    """The Gram identity ‖Σ_t y_t x_tᵀ‖² = Σ_ts (y_t·y_s)(x_t·x_s), with the Gram matrices the
    book-keeping engine forms (fp32 blocks for the inputs, fp64 for the output gradients): 0
    for every crafted canary, whose true norm is 100·C; right for the plain ones."""
    from opake.dpsgd.certify import gram, wide

    canaries = GradientCanaries(8, seed=0)
    x, y = _padded(canaries, list(range(8)))
    assert not wide(x)  # inputs: fp32 blocks (the numerics the crafted canaries target)
    assert wide(y)  # output gradients: fp64
    ghost = (gram(y) * gram(x)).sum(dim=(1, 2))[:8]
    for label, value in zip(canaries.labels, ghost.tolist(), strict=True):
        assert value == (0.0 if label in CRAFTED_KINDS else pytest.approx(100.0**2)), label


@pytest.mark.parametrize("engine", ["auto", "bookkeeping", "vmap"])
@pytest.mark.parametrize("kind", ["dirac", "random"])
def test_clipped_sum_is_c_times_each_direction(kind, engine):
    canaries = GradientCanaries(8, kind=kind, seed=1)
    run = canaries.run([True] * 8, dataset_size=3, clipping_norm=0.5, engine=engine)
    u = canaries.directions().double()
    for i in range(8):  # each canary alone: its gradient (100·C along u_i) clipped to C
        grads = run.clipped_sum([i])
        got = grads[CANARY_PARAMETER].double().flatten()
        assert grads.max_norm == 0.5
        assert torch.allclose(got, 0.5 * u[i], atol=1e-5), canaries.labels[i]
    grads = run.clipped_sum([1, 4, 4])
    expected = sum(0.5 * u[i] for i in (1, 4, 4))
    assert torch.allclose(grads[CANARY_PARAMETER].double().flatten(), expected, atol=1e-5)
    empty = run.clipped_sum([])
    assert torch.count_nonzero(empty[CANARY_PARAMETER]) == 0
    used = "vmap" if engine == "vmap" else "bookkeeping"
    assert run.engines == {used: 10}
    assert run.engine_used == used


def test_a_trusted_gram_norm_lets_exactly_the_crafted_canaries_through(monkeypatch):
    from opake.dpsgd.bookkeeping._certify import LeafBounds
    from opake.dpsgd.bookkeeping._fused import LeafBoundsFn

    original = LeafBoundsFn.__call__  # what the runner asks for every leaf's bounds

    def leaf_bounds(self, *args, **kwargs):  # the computed norm, no error terms, no exact route
        leaf = original(self, *args, **kwargs)
        zero = torch.zeros_like(leaf.sq)
        return LeafBounds(leaf.sq, leaf.sq.sqrt(), zero, zero > 0, leaf.rounding)

    monkeypatch.setattr(LeafBoundsFn, "__call__", leaf_bounds)
    canaries = GradientCanaries(8, seed=2)
    run = canaries.run([True] * 8, dataset_size=3, clipping_norm=1.0, engine="bookkeeping")
    run.clipped_sum([0])  # the engine's first-call check runs on a plain canary
    u = canaries.directions().double()
    for i, label in enumerate(canaries.labels):
        got = run.clipped_sum([i])[CANARY_PARAMETER].double().flatten()
        expected = 100.0 if label in CRAFTED_KINDS else 1.0  # the whole gradient, or C
        assert float(got @ u[i]) == pytest.approx(expected, rel=1e-4), label
    assert run.engines == {"bookkeeping": 9}


def test_the_engine_is_one_clipped_grad_accepts():
    run = GradientCanaries(4).run([True] * 4, dataset_size=1, clipping_norm=1.0)
    with pytest.raises(ConfigurationError, match="engine='fast'"):
        run.clipped_sum([0], engine="fast")
    with pytest.raises(ConfigurationError, match="engine="):
        GradientCanaries(4).run([True] * 4, dataset_size=1, clipping_norm=1.0, engine="ghost")


def test_split_maps_slots_to_included_canaries_only():
    run = GradientCanaries(4).run([True, False, True, False], dataset_size=10, clipping_norm=1.0)
    assert run.total_size == 14
    real, ids = run.split([0, 9, 10, 11, 12, 13])
    assert real == [0, 9]
    assert ids == [0, 2]
    with pytest.raises(OperationError, match="beyond"):
        run.split([14])


def test_scores_are_the_projections_of_the_noisy_sums():
    from opake.dpsgd.optimizer import DPOptimizer

    canaries = GradientCanaries(3)
    run = canaries.run([True, True, False], dataset_size=5, clipping_norm=1.0)
    u = canaries.directions().double()
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
        sums.append(u @ (run.parameter.grad.double().flatten() * 4.0))  # along each direction
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
    with pytest.raises(ConfigurationError, match="crafted kinds"):
        GradientCanaries(3, kind="underflow")
    with pytest.raises(ConfigurationError, match="dimension"):
        GradientCanaries(3, kind="dirac", dimension=9)
    with pytest.raises(ConfigurationError, match="entries"):
        GradientCanaries(3).run([True], dataset_size=1, clipping_norm=1.0)
    with pytest.raises(ConfigurationError, match="crafted=False"):
        GradientCanaries(3).run([True] * 3, dataset_size=1, clipping_norm=1e20)
    GradientCanaries(3, crafted=False).run([True] * 3, dataset_size=1, clipping_norm=1e20)


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
