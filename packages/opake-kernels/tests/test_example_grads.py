"""``linear_cross_entropy_example_grads``: the per-example gradients of the projection inside a
linear cross-entropy, held implicitly, against the obvious reference — each example's gradient
by plain autograd through the torch reference loss, one example at a time (float64)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opake.core import ops
from opake.core.errors import ConfigurationError, InputTypeError, OperationError
from opake.kernels import kernel_choice, linear_cross_entropy
from opake.kernels import linear_cross_entropy_example_grads as example_grads
from opake.kernels.chunked import (
    LinearCEExampleGrads,
    lce_ghost_is_cheaper,
    linear_cross_entropy_recorded,
)

OPTIONS = {
    "plain": {},
    "bias": {"bias": True},
    "scale+divisor": {"logit_scale": 1.7, "logit_divisor": 2.0},
    "softcap": {"softcap": 2.5},
    "smoothing": {"label_smoothing": 0.2},
    "everything": {"bias": True, "logit_scale": 0.8, "softcap": 3.0, "label_smoothing": 0.1},
}


def _inputs(gen, b=3, t=6, h=8, v=41, *, bias=False):
    hidden = torch.randn(b, t, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64) * h**-0.5
    labels = torch.randint(0, v, (b, t), generator=gen)
    labels[1, t // 2 :] = -100  # a padded example
    grads = torch.rand(b, t, generator=gen, dtype=torch.float64) + 0.5
    b_ = torch.randn(v, generator=gen, dtype=torch.float64) if bias else None
    return hidden, weight, labels, grads, b_


def _per_example(hidden, weight, labels, grads, bias, **opts):
    """``[B, V, H]`` and ``[B, V]``: example i's gradient of Σ_t grads[i,t]·loss[i,t] (autograd)."""
    gws, gbs = [], []
    for i in range(hidden.shape[0]):
        w = weight.detach().clone().requires_grad_(True)
        b = None if bias is None else bias.detach().clone().requires_grad_(True)
        tok = linear_cross_entropy(
            hidden[i], w, labels[i], bias=b, reduction="none", backend="torch", **opts
        )
        (tok * grads[i]).sum().backward()
        gws.append(w.grad)
        gbs.append(None if b is None else b.grad)
    return torch.stack(gws), None if bias is None else torch.stack(gbs)


def _fp32(*tensors):
    return [None if x is None else x.float() for x in tensors]


@pytest.mark.parametrize("route", ["ghost", "materialised"])
@pytest.mark.parametrize("chunk", [True, 7, False])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_norms_and_clipped_sum_equal_autograd_per_example(gen, option, chunk, route):
    opts = dict(OPTIONS[option])
    with_bias = opts.pop("bias", False)
    hidden, weight, labels, grads, bias = _inputs(gen, bias=with_bias)
    want_w, want_b = _per_example(hidden, weight, labels, grads, bias, **opts)
    h32, w32, g32, b32 = _fp32(hidden, weight, grads, bias)
    op = example_grads(h32, w32, labels, g32, bias=b32, chunk_size=chunk, route=route, **opts)
    assert isinstance(op, LinearCEExampleGrads)
    assert op.route == route
    assert (op.batch, op.shape) == (3, (41, 8))
    w_sq, b_sq = op.sq_norms()
    torch.testing.assert_close(w_sq.double(), want_w.square().sum((1, 2)), rtol=1e-5, atol=1e-7)
    coef = torch.tensor([0.3, 1.0, 0.05], dtype=torch.float64)
    got_w, got_b = op.weighted_sum(coef.float())
    torch.testing.assert_close(
        got_w.double(), torch.einsum("b,bvh->vh", coef, want_w), rtol=1e-5, atol=1e-6
    )
    if with_bias:
        torch.testing.assert_close(b_sq.double(), want_b.square().sum(1), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(op.bias_grads().double(), want_b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_b.double(), coef @ want_b, rtol=1e-5, atol=1e-6)
    else:
        assert b_sq is None
        assert got_b is None
        assert op.bias_grads() is None


@pytest.mark.parametrize("option", ["plain", "everything"])
def test_inner_products_with_a_tied_embedding_and_a_dense_use(gen, option):
    """``⟨G_i, Σ_s a_s ⊗ b_s⟩`` for one-hot rows (a tied input embedding: ids, including the
    label ids themselves) and for dense rows, against the materialised gradients."""
    opts = dict(OPTIONS[option])
    with_bias = opts.pop("bias", False)
    hidden, weight, labels, grads, bias = _inputs(gen, bias=with_bias)
    want_w, _ = _per_example(hidden, weight, labels, grads, bias, **opts)
    h32, w32, g32, b32 = _fp32(hidden, weight, grads, bias)
    op = example_grads(h32, w32, labels, g32, bias=b32, chunk_size=5, **opts)
    ids = torch.randint(0, 41, (3, 9), generator=gen)
    ids[:, :6] = labels.clamp_min(0)  # columns that hit the targets
    e = torch.randn(3, 9, 8, generator=gen, dtype=torch.float64)
    onehot = torch.zeros(3, 9, 41, dtype=torch.float64).scatter_(2, ids[..., None], 1.0)
    emb = torch.einsum("bsv,bsh->bvh", onehot, e)
    want = (want_w * emb).sum((1, 2))
    torch.testing.assert_close(op.inner_outer(ids, e.float()).double(), want, rtol=1e-5, atol=1e-6)
    dense = torch.randn(3, 4, 41, generator=gen, dtype=torch.float64)
    e2 = e[:, :4]
    want2 = (want_w * torch.einsum("bsv,bsh->bvh", dense, e2)).sum((1, 2))
    got2 = op.inner_outer(dense.float(), e2.float()).double()
    torch.testing.assert_close(got2, want2, rtol=1e-5, atol=1e-6)
    # the projection itself: the logit gradients at the given columns
    proj = op.project(ids)
    assert proj.shape == (3, 6, 9)


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 3),
    t=st.integers(1, 12),
    h=st.integers(1, 12),
    v=st.integers(2, 40),
    chunk=st.sampled_from([True, 3, 16, False]),
    seed=st.integers(0, 2**16),
)
def test_ghost_and_materialised_agree_on_random_shapes(b, t, h, v, chunk, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=gen)
    weight = torch.randn(v, h, generator=gen)
    labels = torch.randint(-1, v, (b, t), generator=gen)  # -1 plays ignore_index
    grads = torch.rand(b, t, generator=gen)
    ghost = example_grads(
        hidden, weight, labels, grads, ignore_index=-1, chunk_size=chunk, route="ghost"
    )
    mat = example_grads(
        hidden, weight, labels, grads, ignore_index=-1, chunk_size=chunk, route="materialised"
    )
    want, _ = _per_example(
        hidden.double(), weight.double(), labels, grads.double(), None, ignore_index=-1
    )
    expected = want.square().sum((1, 2)).float()
    torch.testing.assert_close(ghost.sq_norms()[0], expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mat.sq_norms()[0], expected, rtol=1e-4, atol=1e-5)


def test_kept_rows_only_and_non_finite_rows_contribute_zero(gen):
    hidden, weight, labels, grads, _ = _inputs(gen)
    hidden = hidden.float()
    hidden[2, 0, 0] = float("nan")
    op = example_grads(hidden, weight.float(), labels, grads.float())
    assert not torch.isfinite(op.sq_norms()[0][2])
    keep = torch.tensor([True, True, False])
    got, _ = op.weighted_sum(torch.ones(3), keep)
    assert torch.isfinite(got).all()
    want_w, _ = _per_example(hidden[:2].double(), weight, labels[:2], grads[:2], None)
    torch.testing.assert_close(got.double(), want_w.sum(0), rtol=1e-5, atol=1e-6)


def test_ignored_tokens_carry_no_gradient_even_with_nan_upstream(gen):
    hidden, weight, labels, grads, _ = _inputs(gen)
    grads = grads.float()
    grads[1, -1] = float("nan")  # labels[1, -1] is ignored
    op = example_grads(hidden.float(), weight.float(), labels, grads)
    assert torch.isfinite(op.sq_norms()[0]).all()


def test_half_precision_inputs_give_fp32_results_close_to_fp32(gen):
    hidden, weight, labels, grads, _ = _inputs(gen)
    ref = example_grads(hidden.float(), weight.float(), labels, grads.float())
    low = example_grads(hidden.bfloat16(), weight.bfloat16(), labels, grads.float(), chunk_size=8)
    w_sq, _ = low.sq_norms()
    assert w_sq.dtype == torch.float32
    torch.testing.assert_close(w_sq, ref.sq_norms()[0], rtol=5e-2, atol=1e-3)
    total, _ = low.weighted_sum(torch.ones(3))
    assert total.dtype == torch.float32


def test_route_rule_and_auto():
    assert lce_ghost_is_cheaper(64, 256, 4096)
    assert not lce_ghost_is_cheaper(512, 256, 4096)
    hidden = torch.randn(1, 4, 16)
    op = example_grads(
        hidden, torch.randn(50, 16), torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4)
    )
    assert op.route == "ghost"
    long = torch.randn(1, 40, 4)
    op = example_grads(
        long, torch.randn(50, 4), torch.zeros(1, 40, dtype=torch.long), torch.ones(1, 40)
    )
    assert op.route == "materialised"
    assert "route='materialised'" in repr(op)


def test_bad_input_raises_typed_errors():
    h, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    y, g = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3)
    with pytest.raises(ConfigurationError, match="batch on dimension 0"):
        example_grads(h[0], w, y[0], g[0])
    with pytest.raises(ConfigurationError, match="token_grads of shape"):
        example_grads(h, w, y, g[:, :2])
    with pytest.raises(InputTypeError, match="token_grads must be a tensor"):
        example_grads(h, w, y, 1.0)
    with pytest.raises(ConfigurationError, match="route='fast'"):
        example_grads(h, w, y, g, route="fast")
    with pytest.raises(TypeError, match="unexpected keyword"):
        example_grads(h, w, y, g, reduction="mean")
    op = example_grads(h, w, y, g)
    with pytest.raises(ConfigurationError, match="weights of shape"):
        op.weighted_sum(torch.ones(3))
    with pytest.raises(ConfigurationError, match="ids of shape"):
        op.project(torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ConfigurationError, match="rows of shape"):
        op.project(torch.zeros(2, 2, 7))


def test_selection_picks_chunked_and_an_explicit_backend_without_the_op_fails():
    assert kernel_choice(ops.LINEAR_CROSS_ENTROPY_EXAMPLE_GRADS, "cpu").backend == "chunked"
    h, w = torch.randn(1, 2, 4), torch.randn(5, 4)
    y, g = torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2)
    with pytest.raises(OperationError, match="requested explicitly"):
        example_grads(h, w, y, g, backend="torch")


@pytest.mark.parametrize("route", ["ghost", "materialised"])
@pytest.mark.parametrize("option", ["plain", "everything"])
def test_recorded_loss_backward_gives_hidden_grads_and_the_norms_in_one_pass(gen, option, route):
    """``linear_cross_entropy_recorded``: per-token losses as ``linear_cross_entropy``'s, the
    hidden gradient as autograd's, and after the backward the record holds the per-example
    gradients — whose norms that backward computed when it recomputed the logits (no further
    vocabulary pass for them); with kept logit gradients nothing is recomputed, and the norms
    are formed when asked (the clipping engine certifies them from the kept gradients)."""
    opts = dict(OPTIONS[option])
    with_bias = opts.pop("bias", False)
    hidden, weight, labels, grads, bias = _inputs(gen, bias=with_bias)
    want_w, want_b = _per_example(hidden, weight, labels, grads, bias, **opts)
    h32, w32, g32, b32 = _fp32(hidden, weight, grads, bias)
    leaf = h32.clone().requires_grad_(True)
    tok, record = linear_cross_entropy_recorded(
        leaf, w32, labels, bias=b32, chunk_size=7, route=route, **opts
    )
    ref_leaf = h32.clone().requires_grad_(True)
    ref = linear_cross_entropy(
        ref_leaf, w32, labels, bias=b32, reduction="none", backend="torch", **opts
    )
    torch.testing.assert_close(tok, ref)
    (tok * g32).sum().backward()
    (ref * g32).sum().backward()
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-5, atol=1e-6)
    assert record.grads is not None
    kept = record.kept is not None and record.kept.u is not None
    assert (record.grads._norms is None) == kept  # the recomputing backward formed them
    op = record.example_grads(g32)
    assert op is record.grads
    torch.testing.assert_close(
        op.sq_norms()[0].double(), want_w.square().sum((1, 2)), rtol=1e-5, atol=1e-7
    )
    if with_bias:
        torch.testing.assert_close(op.bias_grads().double(), want_b, rtol=1e-5, atol=1e-6)
    coef = torch.tensor([0.3, 1.0, 0.05])
    torch.testing.assert_close(
        op.weighted_sum(coef)[0].double(),
        torch.einsum("b,bvh->vh", coef.double(), want_w),
        rtol=1e-5,
        atol=1e-6,
    )
    # other upstream gradients than the backward's: built anew (with the forward's lse)
    other = record.example_grads(2 * g32)
    assert other is not op
    torch.testing.assert_close(other.sq_norms()[0], 4 * op.sq_norms()[0], rtol=1e-5, atol=1e-6)


def test_recorded_loss_without_a_backward_and_with_a_trainable_weight(gen):
    hidden, weight, labels, grads, _ = _inputs(gen)
    h32, w32, g32 = hidden.float(), weight.float(), grads.float()
    tok, record = linear_cross_entropy_recorded(h32, w32, labels)  # nothing requires grad
    assert not tok.requires_grad
    assert record.grads is None
    assert record.lse is not None  # kept by the forward: no log-sum-exp pass later
    want_w, _ = _per_example(hidden, weight, labels, grads, None)
    got = record.example_grads(g32).sq_norms()[0]
    torch.testing.assert_close(got.double(), want_w.square().sum((1, 2)), rtol=1e-5, atol=1e-7)
    with pytest.raises(ConfigurationError, match=r"weight requires grad.*weight\.detach\(\)"):
        linear_cross_entropy_recorded(h32, w32.requires_grad_(True), labels)
    assert kernel_choice(ops.LINEAR_CROSS_ENTROPY_RECORDED, "cpu").backend == "chunked"
