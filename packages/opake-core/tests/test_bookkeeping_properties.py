"""Property tests of the book-keeping engine's DP invariants, for arbitrary magnitudes.

For any batch: no example's clipped contribution exceeds C (a batch of one is exactly that
contribution), and the clipped sum of a batch is the sum of its examples' clipped
contributions (nothing mixes examples). Together they bound the sensitivity: adding or removing
one example moves the sum by at most C. The per-example gradients here are known in closed form
(``loss_i = Σ_t y_{i,t} · (W x_{i,t} + b)``: ``∇W = Σ_t y_t x_tᵀ``, ``∇b = Σ_t y_t``), from
tiny to huge, so the norms exercise both the Gram and the materialised routes and fp32 overflow.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opake.dpsgd.bookkeeping import BatchedLoss
from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional

ROUNDING = 1e-5  # fp32 rounding of the norm, the factor and the contraction
MAGNITUDE = st.floats(min_value=-30.0, max_value=30.0)  # log10 of an example's scale
CLIP = st.floats(min_value=1e-3, max_value=1e3)


def _case(width: int):
    layer = torch.nn.Linear(width, 3)
    fmodel, params = make_functional(layer)

    def losses(p, x, y):
        return (fmodel(p, x) * y).sum(dim=(1, 2))

    return BatchedLoss(losses, fmodel), params


def _norm(grads) -> float:
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))


@settings(max_examples=40, deadline=None)
@given(
    scales=st.lists(MAGNITUDE, min_size=1, max_size=4),
    # a 4 → 3 layer takes the Gram route up to T = 12/7: T = 1 ghost, T = 3 and 40 materialised
    steps=st.sampled_from([1, 3, 40]),
    clip=CLIP,
    seed=st.integers(0, 2**16),
)
def test_contributions_are_bounded_and_add_up(scales, steps, clip, seed):
    width = 4
    loss, params = _case(width)
    gen = torch.Generator().manual_seed(seed)
    factor = torch.tensor([10.0**s for s in scales])
    x = torch.randn(len(scales), steps, width, generator=gen) * factor[:, None, None]
    y = torch.randn(len(scales), steps, 3, generator=gen)
    grad_fn, state = clipped_grad(
        loss, clipping_norm=clip, batch_argnums=(1, 2), engine="bookkeeping", return_aux=True
    )
    (total, _), _ = grad_fn(params, x, y, state=state)
    assert all(torch.isfinite(g).all() for g in total.values())
    singles = []
    for i in range(len(scales)):
        (one, one_aux), _ = grad_fn(params, x[i : i + 1], y[i : i + 1], state=state)
        assert _norm(one) <= clip * (1 + ROUNDING), (scales[i], _norm(one), clip)
        finite = bool(torch.isfinite(one_aux.grad_norms).all())
        if not finite:  # an overflowing norm: the example contributes exactly zero
            assert _norm(one) == 0.0
        singles.append(one)
    for name, value in total.items():
        expected = sum(s[name].double() for s in singles)
        tol = ROUNDING * clip * len(scales)
        assert float((value.double() - expected).abs().max()) <= tol, name
