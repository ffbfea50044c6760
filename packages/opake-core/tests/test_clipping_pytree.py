"""clipped_grad over a differentiated argument of any pytree structure, against a plain loop."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opake.core.errors import ConfigurationError, InputTypeError
from opake.dpsgd.bookkeeping import BatchedLoss
from opake.dpsgd.clipping import ClippedGrads, clipped_grad


def _structures():
    torch.manual_seed(0)
    a, b, c = torch.randn(3), torch.randn(2, 3), torch.randn(2)
    return {
        "tensor": (a, lambda p, x: (p * x[:3]).sum() ** 2),
        "tuple": ((a, b), lambda p, x: (p[0] * x[:3]).sum() ** 2 + (p[1] @ x[:3]).sum()),
        "list": ([a, c], lambda p, x: torch.tanh((p[0] * x[:3]).sum()) * (p[1] * x[3:]).sum()),
        "nested": (
            {"enc": {"w": b, "b": c}, "head": (a,)},
            lambda p, x: ((p["enc"]["w"] @ x[:3] + p["enc"]["b"]).sum() * p["head"][0].sum()) ** 2,
        ),
    }


def _loop_reference(loss_fn, params, x, clip):
    """Σ_i min(1, C/(‖g_i‖+1e-6)) g_i, per example by plain autograd; same structure."""
    leaves, spec = torch.utils._pytree.tree_flatten(params)
    total = [torch.zeros_like(v, dtype=torch.float64) for v in leaves]
    for i in range(x.shape[0]):
        own = [v.detach().clone().requires_grad_(True) for v in leaves]
        loss = loss_fn(torch.utils._pytree.tree_unflatten(own, spec), x[i])
        grads = torch.autograd.grad(loss, own)
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        factor = min(1.0, clip / (norm + 1e-6))
        for acc, g in zip(total, grads, strict=True):
            acc.add_(factor * g.double())
    return torch.utils._pytree.tree_unflatten(total, spec)


@pytest.mark.parametrize("kind", ["tensor", "tuple", "list", "nested"])
@pytest.mark.parametrize("method", ["auto", "vmap"])
def test_structure_kept_and_equal_to_the_loop(kind, method):
    params, loss_fn = _structures()[kind]
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1)) * 3
    grad_fn, state = clipped_grad(loss_fn, clipping_norm=0.7, microbatch_size=4, engine=method)
    grads, _ = grad_fn(params, x, state=state)
    expected = _loop_reference(loss_fn, params, x, 0.7)
    assert torch.utils._pytree.tree_structure(grads) == torch.utils._pytree.tree_structure(expected)
    for got, want in zip(
        torch.utils._pytree.tree_leaves(grads),
        torch.utils._pytree.tree_leaves(expected),
        strict=True,
    ):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert not isinstance(grads, ClippedGrads)  # plain structure, as torch.func.grad returns


def test_group_clipping_names_nested_leaves_by_path():
    params = {"enc": {"w": torch.ones(2)}, "head": torch.ones(2)}

    def loss_fn(p, x):
        return (p["enc"]["w"] * x).sum() * 10 + (p["head"] * x).sum() * 10

    grad_fn, state = clipped_grad(loss_fn, clipping_norm={"enc": 1.0, "head": 2.0})
    grads, _ = grad_fn(params, torch.ones(1, 2), state=state)
    assert math.isclose(float(grads["enc"]["w"].norm()), 1.0, rel_tol=1e-5)
    assert math.isclose(float(grads["head"].norm()), 2.0, rel_tol=1e-5)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ((torch.zeros(2), 3.0), "entry '1' .* float"),
        ({"a": {"b": torch.zeros(2, dtype=torch.int64)}}, "entry 'a.b' .* torch.int64"),
        ((), "empty tuple"),
        ({"w": "zeros"}, "entry 'w' .* str"),
    ],
)
def test_bad_leaves_say_what_and_how(params, match):
    grad_fn, state = clipped_grad(lambda p, x: x.sum(), clipping_norm=1.0)
    with pytest.raises(InputTypeError, match=match) as info:
        grad_fn(params, torch.ones(2, 2), state=state)
    assert "floating-point tensor" in str(info.value) or "pytree" in str(info.value)


def test_bookkeeping_needs_a_flat_dict():
    lin = torch.nn.Linear(2, 1)

    def losses(p, x):
        out = torch.func.functional_call(lin, {"weight": p[0], "bias": p[1]}, (x,))
        return out[:, 0] ** 2

    fn = BatchedLoss(losses, lin)
    params = (lin.weight.detach(), lin.bias.detach())
    grad_fn, state = clipped_grad(fn, clipping_norm=1.0, engine="bookkeeping")
    with pytest.raises(ConfigurationError, match="flat dict"):
        grad_fn(params, torch.ones(3, 2), state=state)
    auto_fn, state = clipped_grad(fn, clipping_norm=1.0)
    grads, _ = auto_fn(params, torch.ones(3, 2), state=state)
    assert auto_fn.engine == "vmap"
    assert isinstance(grads, tuple)


@settings(max_examples=25, deadline=None)
@given(
    scale=st.floats(min_value=1e-30, max_value=1e30),
    clip=st.floats(min_value=1e-3, max_value=1e3),
    kind=st.sampled_from(["tensor", "tuple", "list", "nested"]),
)
def test_one_example_never_moves_the_sum_by_more_than_c(scale, clip, kind):
    """Search for a structure, gradient scale and bound where one example's clipped
    contribution exceeds C (each example alone: the sum of a batch of one), up to the fp32
    rounding of the scaled entries that the privacy suite allows."""
    params, loss_fn = _structures()[kind]
    x = torch.full((1, 5), 1.0) * scale
    grad_fn, state = clipped_grad(loss_fn, clipping_norm=clip, check_unused=False)
    grads, _ = grad_fn(params, x, state=state)
    norm = math.sqrt(
        sum(float(g.double().square().sum()) for g in torch.utils._pytree.tree_leaves(grads))
    )
    assert norm <= clip * (1 + 1e-6)  # fp32 rounding of the scaled sum, as everywhere
