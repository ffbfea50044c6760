"""Reproductions of the clipping attacks that broke the book-keeping engine, as regressions.

Each test isolates one example's contribution to the clipped sum with ``example_mask`` (every
other example masked out contributes exactly zero) and asserts the bound ``‖contribution‖ ≤ C``
(up to ``1e-6`` relative), or compares the clipped sum with the per-example loop of plain
autograd (:mod:`opake.core.testing`).
"""

from __future__ import annotations

import math

import pytest
import torch

from opake.core import testing
from opake.dpsgd.bookkeeping import BatchedLoss
from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional

F = torch.nn.functional
BOUND = 1.0 + 1e-12  # the oracle's own fp64 rounding: the bound is proven


def _norm(grads) -> float:
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))


def _contribution(grad_fn, state, args, batch, i):
    mask = torch.zeros(batch, dtype=torch.bool)
    mask[i] = True
    out, _ = grad_fn(*args, state=state, example_mask=mask)
    grads = out[0] if isinstance(out, tuple) else out
    return _norm(grads)


def _mse_case(seed: int):
    """``nn.Linear(64, 64)`` over 32 tokens, MSE; example 2 repeats one input vector and its
    targets alternate in sign with amplitude 1e5 (no knowledge of the weights needed)."""
    torch.manual_seed(seed)
    layer = torch.nn.Linear(64, 64)
    fmodel, params = make_functional(layer)

    def losses(p, x, y):
        return ((fmodel(p, x) - y) ** 2).sum(dim=2).mean(dim=1)

    batch, steps = 4, 32
    x, y = torch.randn(batch, steps, 64), torch.randn(batch, steps, 64)
    x[2] = torch.randn(64)
    sign = torch.tensor([(-1.0) ** t for t in range(steps)])
    y[2] = 1e5 * sign[:, None] * torch.randn(64).sign()
    return BatchedLoss(losses, fmodel), params, x, y


@pytest.mark.parametrize("seed", [0, 6, 18])
def test_alternating_targets_do_not_escape_clipping(seed):
    loss, params, x, y = _mse_case(seed)
    grad_fn, state = clipped_grad(loss, clipping_norm=1.0, batch_argnums=(1, 2))
    args = (params, x, y)
    for i in range(4):
        assert _contribution(grad_fn, state, args, 4, i) <= BOUND, i
    assert grad_fn.engine == "bookkeeping"
    # and the sum is the per-example loop's, run in fp64: the attack example is clipped from
    # its true norm (to the accuracy its fp32 output gradients allow: y ± 1e5 leaves each
    # token's gradient ~1e5·2⁻²⁴ off before any clipping code runs)
    one = loss.per_example(batch_argnums=(1, 2), has_aux=False)
    grads, _ = grad_fn(*args, state=state)
    args64 = ({k: v.double() for k, v in params.items()}, x.double(), y.double())
    want = testing.reference_clipped_grad(one, args64, clipping_norm=1.0, batch_argnums=(1, 2))
    testing.assert_grads_close(grads, want, rtol=1e-2)


def _outer_case():
    """``loss_i = Σ_t y_t · (W x_t + b)``: the output gradients ``y_t`` are the attacker's."""
    layer = torch.nn.Linear(64, 64)
    fmodel, params = make_functional(layer)

    def losses(p, x, y):
        return (fmodel(p, x) * y).sum(dim=(1, 2))

    return BatchedLoss(losses, fmodel), params


@pytest.mark.parametrize("amplitude", [1e4, 1e8, 1e15])
def test_crafted_output_gradients_do_not_escape_clipping(amplitude):
    loss, params = _outer_case()
    gen = torch.Generator().manual_seed(3)
    batch, steps = 3, 32
    x = torch.randn(batch, steps, 64, generator=gen)
    y = torch.randn(batch, steps, 64, generator=gen)
    x[1] = torch.randn(64, generator=gen)
    z = torch.randn(64, generator=gen)
    sign = torch.tensor([(-1.0) ** t for t in range(steps)])
    y[1] = amplitude * sign[:, None] * z + torch.randn(steps, 64, generator=gen)
    grad_fn, state = clipped_grad(
        loss, clipping_norm=1.0, batch_argnums=(1, 2), engine="bookkeeping"
    )
    for i in range(batch):
        assert _contribution(grad_fn, state, (params, x, y), batch, i) <= BOUND, i
