"""The recorded linear cross-entropy keeping its logit gradients in the forward pass: every
result (losses, the hidden states' gradient, per-example norms and bias gradients, clipped sums,
the certification's bound and exact rows, cross terms) against the obvious reference — each
example's gradient by plain autograd, one example at a time (float64) — and against the
recomputing path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from opake.core.errors import ConfigurationError
from opake.kernels import linear_cross_entropy
from opake.kernels.chunked import _kept, linear_cross_entropy_recorded

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


def _recorded(hidden, weight, labels, grads, bias, keep, **kw):
    """The recorded op's losses, the hidden states' gradient and the record, after a backward
    with upstream gradients ``grads``."""
    leaf = hidden.clone().requires_grad_(True)
    tok, record = linear_cross_entropy_recorded(
        leaf, weight, labels, bias=bias, keep_logit_grads=keep, **kw
    )
    (tok * grads).sum().backward()
    return tok, leaf.grad, record


@pytest.mark.parametrize("route", ["ghost", "materialised"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_kept_logit_grads_give_every_result_of_the_reference(gen, option, route):
    opts = dict(OPTIONS[option])
    with_bias = opts.pop("bias", False)
    hidden, weight, labels, grads, bias = _inputs(gen, bias=with_bias)
    want_w, want_b = _per_example(hidden, weight, labels, grads, bias, **opts)
    h32, w32, g32 = hidden.float(), weight.float(), grads.float()
    b32 = None if bias is None else bias.float()
    tok, gh, record = _recorded(h32, w32, labels, g32, b32, True, route=route, **opts)
    assert record.kept is not None
    assert record.kept.hidden_grad is None  # u W freed after the backward
    ref_tok, ref_gh, ref_rec = _recorded(
        h32, w32, labels, g32, b32, False, chunk_size=7, route=route, **opts
    )
    assert ref_rec.kept is None
    torch.testing.assert_close(tok, ref_tok)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-5, atol=1e-6)
    op, ref = record.example_grads(g32), ref_rec.example_grads(g32)
    assert op is record.grads
    torch.testing.assert_close(
        op.sq_norms()[0].double(), want_w.square().sum((1, 2)), rtol=1e-5, atol=1e-7
    )
    torch.testing.assert_close(op.abs_norms(), ref.abs_norms(), rtol=1e-5, atol=1e-7)
    coef = torch.tensor([0.3, 1.0, 0.05])
    got_w, got_b = op.weighted_sum(coef)
    torch.testing.assert_close(
        got_w.double(), torch.einsum("b,bvh->vh", coef.double(), want_w), rtol=1e-5, atol=1e-6
    )
    if with_bias:
        torch.testing.assert_close(op.bias_grads().double(), want_b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_b.double(), coef.double() @ want_b, rtol=1e-5, atol=1e-6)
    else:
        assert got_b is None
    torch.testing.assert_close(op.example_rows(1, 3, 20), want_w[1, 3:20], rtol=1e-5, atol=1e-6)
    ids = torch.randint(0, 41, (3, 5), generator=gen)
    dense = torch.randn(3, 4, 41, generator=gen)
    for other in (ids, dense):
        torch.testing.assert_close(op.project(other), ref.project(other), rtol=1e-5, atol=1e-6)
    # other upstream gradients than the backward's: built anew, still from the kept gradients
    again = record.example_grads(2 * g32)
    assert again is not op
    torch.testing.assert_close(again.sq_norms()[0], 4 * op.sq_norms()[0], rtol=1e-5, atol=1e-6)


def test_kept_clipped_sum_leaves_out_dropped_non_finite_examples(gen):
    hidden, weight, labels, grads, _ = _inputs(gen)
    h32 = hidden.float()
    h32[2, 0, 0] = float("nan")
    _, _, record = _recorded(h32, weight.float(), labels, grads.float(), None, True)
    op = record.example_grads(grads.float())
    assert not torch.isfinite(op.sq_norms()[0][2])
    got, _ = op.weighted_sum(torch.ones(3), torch.tensor([True, True, False]))
    assert torch.isfinite(got).all()
    want, _ = _per_example(hidden[:2], weight, labels[:2], grads[:2], None)
    torch.testing.assert_close(got.double(), want.sum(0), rtol=1e-5, atol=1e-6)
    # every example kept: the same products as without a mask on the finite ones
    two, _ = (
        _recorded(hidden[:2].float(), weight.float(), labels[:2], grads[:2].float(), None, True)[2]
        .example_grads(grads[:2].float())
        .weighted_sum(torch.ones(2), torch.tensor([True, True]))
    )
    torch.testing.assert_close(two, got)


def test_kept_is_automatic_when_one_tile_spans_the_vocabulary_and_fits(gen, monkeypatch):
    hidden, weight, labels, grads, _ = _inputs(gen)
    args = (hidden.float(), weight.float(), labels, grads.float(), None, None)
    assert _recorded(*args)[2].kept is not None
    narrow = _recorded(*args, chunk_size=7)[2].kept  # tiles narrower than the vocabulary
    assert narrow is not None
    assert narrow.u is not None  # kept all the same: its rows are no workspace
    monkeypatch.setattr(_kept, "available_memory", lambda device: 1024)  # 3·6·41·4 B > 1024 / 8
    kept = _recorded(*args, route="ghost")[2].kept
    assert kept is not None  # u does not fit: the Gram form
    assert kept.u is None
    assert kept.gram is not None
    assert _recorded(*args, route="materialised")[2].kept is None
    with pytest.raises(ConfigurationError, match="keep_logit_grads='yes'"):
        linear_cross_entropy_recorded(hidden, weight, labels, keep_logit_grads="yes")


def test_kept_automatic_route_is_the_gram_route_up_to_twice_the_recomputing_bound(gen):
    # T·(V + H) = 6·45 = 270: above V·H = 164 (the recomputing path's materialised route) but
    # within 2·V·H, where the kept gradients' Gram route is the faster one
    hidden, weight, labels, grads, _ = _inputs(gen, h=4)
    want, _ = _per_example(hidden, weight, labels, grads, None)
    args = (hidden.float(), weight.float(), labels, grads.float(), None)
    for keep, route in ((True, "ghost"), (False, "materialised")):
        _, _, record = _recorded(*args, keep)
        assert record.route == route
        op = record.example_grads(grads.float())
        assert op.route == route
        torch.testing.assert_close(
            op.sq_norms()[0].double(), want.square().sum((1, 2)), rtol=1e-5, atol=1e-7
        )
    # a route asked for is kept
    assert _recorded(*args, True, route="materialised")[2].grads.route == "materialised"
    # past twice the bound the kept gradients take the materialised route too
    hidden, weight, labels, grads, _ = _inputs(gen, t=8, h=4)  # 8·45 = 360 > 328
    record = _recorded(hidden.float(), weight.float(), labels, grads.float(), None, True)[2]
    assert record.grads.route == "materialised"


def test_kept_half_precision_inputs_give_fp32_results_close_to_fp32(gen):
    hidden, weight, labels, grads, _ = _inputs(gen)
    g32 = grads.float()
    _, gh, rec = _recorded(hidden.bfloat16(), weight.bfloat16(), labels, g32, None, True)
    _, ref_gh, ref = _recorded(hidden.float(), weight.float(), labels, g32, None, True)
    assert gh.dtype == torch.bfloat16
    torch.testing.assert_close(gh.float(), ref_gh, rtol=5e-2, atol=2e-2)
    w_sq = rec.example_grads(g32).sq_norms()[0]
    assert w_sq.dtype == torch.float32
    torch.testing.assert_close(w_sq, ref.example_grads(g32).sq_norms()[0], rtol=5e-2, atol=1e-3)


EPS32 = 2.0**-24  # fp32 unit roundoff


def _gamma(k: int) -> float:
    """``γ_k = k·u / (1 − k·u)``: the relative error of a k-term fp32 sum or product chain."""
    return k * EPS32 / (1 - k * EPS32)


def _fp32_error_bounds(hidden, weight, labels, grads, coef, ignore_index):
    """First-order bounds on the rounding error of one fp32 evaluation of the hidden states'
    gradient ``g_n Σ_v (p − y)_{n,v} W_v`` and of the weighted sum
    ``S = Σ_n c_n g_n (p − y)_n ⊗ x_n``, from the inputs (computed in float64), whatever the
    order of the sums (tiles, chunks, matrix-product blocking):

    * a logit ``z = x·W_v`` (h products): ``|δz| ≤ γ_h Σ_k |x_k W_{v,k}|``;
    * the log-sum-exp over V logits: ``|δlse| ≤ max_v |δz| + γ_{V+4}(1 + |lse| + max_v |z − lse|)``;
    * so ``p = exp(z − lse)`` has relative error ``ρ ≤ |δz| + |δlse| + u|z − lse| + 2u``, and the
      token's logit gradient ``d = c g (p − y)`` is off by ``|c g|(p ρ + 3u|p − y|)``;
    * a sum of N such terms, each with its rounding, adds ``γ_N Σ|terms|``.

    Two evaluations (kept and recomputed) differ by at most twice the bound.
    """
    x, w = hidden.double().reshape(-1, hidden.shape[-1]), weight.double()
    n, (v, h) = x.shape[0], w.shape
    valid = (labels.reshape(-1) != ignore_index).double()[:, None]
    z = x @ w.t()
    lse = torch.logsumexp(z, dim=1, keepdim=True)
    prob = torch.exp(z - lse)
    y = torch.nn.functional.one_hot(labels.reshape(-1).clamp(min=0), v).double()
    dz = _gamma(h) * (x.abs() @ w.abs().t())
    dlse = dz.amax(1, keepdim=True) + _gamma(v + 4) * (
        1 + lse.abs() + (z - lse).abs().amax(1, keepdim=True)
    )
    rho = dz + dlse + EPS32 * (z - lse).abs() + 2 * EPS32

    def logit_grads(scale):  # d = scale·(p − y) per token, and the bound on its error
        scale = scale.reshape(-1, 1) * valid
        d = scale * (prob - y)
        return d.abs(), scale.abs() * (prob * rho + 3 * EPS32 * (prob - y).abs())

    d, dd = logit_grads(grads.double())
    hidden_grad = dd @ w.abs() + _gamma(v) * (d @ w.abs())
    d, dd = logit_grads(grads.double() * coef.double()[:, None])
    weighted_sum = dd.t() @ x.abs() + _gamma(n) * (d.t() @ x.abs())
    return hidden_grad.reshape(hidden.shape), weighted_sum


def _assert_within(got, want, bound):
    excess = (got.double() - want.double()).abs() - bound
    assert bool((excess <= 0).all()), (
        f"differ by more than the fp32 error bound: {excess.max().item():.3g} over it"
    )


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 3),
    t=st.integers(1, 10),
    h=st.integers(1, 10),
    v=st.integers(2, 30),
    route=st.sampled_from(["ghost", "materialised"]),
    chunk=st.sampled_from([True, 3]),
    seed=st.integers(0, 2**16),
)
# drawn once by a random search: weighted sums 1.3e-5 apart where terms of ~1 cancel to ~2e-3
@example(b=2, t=5, h=10, v=16, route="ghost", chunk=True, seed=321)
def test_kept_and_recomputed_agree_on_random_shapes(b, t, h, v, route, chunk, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=gen) * 3
    weight = torch.randn(v, h, generator=gen)
    labels = torch.randint(-1, v, (b, t), generator=gen)  # -1 plays ignore_index
    grads = torch.randn(b, t, generator=gen)
    kw = {"ignore_index": -1, "route": route}
    _, gh, rec = _recorded(hidden, weight, labels, grads, None, True, chunk_size=chunk, **kw)
    _, ref_gh, ref = _recorded(hidden, weight, labels, grads, None, False, chunk_size=1, **kw)
    coef = torch.rand(b, generator=gen)
    gh_bound, sum_bound = _fp32_error_bounds(hidden, weight, labels, grads, coef, -1)
    _assert_within(gh, ref_gh, 2 * gh_bound)
    op, ref_op = rec.example_grads(grads), ref.example_grads(grads)
    want, _ = _per_example(
        hidden.double(), weight.double(), labels, grads.double(), None, ignore_index=-1
    )
    torch.testing.assert_close(
        op.sq_norms()[0].double(), want.square().sum((1, 2)), rtol=1e-4, atol=1e-5
    )
    assert bool((op.abs_norms() >= want.square().sum((1, 2)).sqrt() * (1 - 1e-5) - 1e-6).all())
    _assert_within(op.weighted_sum(coef)[0], ref_op.weighted_sum(coef)[0], 2 * sum_bound)
    # each is within its own bound of the exact (float64) weighted sum, too
    exact = torch.einsum("b,bvh->vh", coef.double(), want)
    _assert_within(op.weighted_sum(coef)[0], exact, sum_bound)
    _assert_within(ref_op.weighted_sum(coef)[0], exact, sum_bound)


@pytest.mark.parametrize("option", ["plain", "everything"])
def test_gram_form_gives_every_result_of_the_reference(gen, monkeypatch, option):
    """When ``u`` does not fit: the forward keeps ``u W`` and each example's Gram matrix of
    ``u``; the backward and the norms use them, the clipped sum recomputes the tiles once."""
    opts = dict(OPTIONS[option])
    opts.pop("bias", None)  # the Gram form is for a projection without bias
    monkeypatch.setattr(_kept, "available_memory", lambda device: 1024)
    hidden, weight, labels, grads, _ = _inputs(gen, t=5)
    want_w, _ = _per_example(hidden, weight, labels, grads, None, **opts)
    h32, w32, g32 = hidden.float(), weight.float(), grads.float()
    tok, gh, record = _recorded(h32, w32, labels, g32, None, None, route="ghost", **opts)
    assert record.kept is not None
    assert record.kept.u is None
    ref_tok, ref_gh, ref_rec = _recorded(
        h32, w32, labels, g32, None, False, chunk_size=7, route="ghost", **opts
    )
    torch.testing.assert_close(tok, ref_tok)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-5, atol=1e-6)
    op, ref = record.example_grads(g32), ref_rec.example_grads(g32)
    assert op._norms is not None  # from the forward's Gram matrices, in the backward
    torch.testing.assert_close(
        op.sq_norms()[0].double(), want_w.square().sum((1, 2)), rtol=1e-5, atol=1e-7
    )
    torch.testing.assert_close(op.abs_norms(), ref.abs_norms(), rtol=1e-5, atol=1e-7)
    coef = torch.tensor([0.3, 1.0, 0.05])
    torch.testing.assert_close(
        op.weighted_sum(coef)[0].double(),
        torch.einsum("b,bvh->vh", coef.double(), want_w),
        rtol=1e-5,
        atol=1e-6,
    )
    # the hidden states' gradient again (u W freed): the recomputing tile pass
    torch.testing.assert_close(op.hidden_grad(), ref_gh, rtol=1e-5, atol=1e-6)
    again = record.example_grads(2 * g32)
    torch.testing.assert_close(again.sq_norms()[0], 4 * op.sq_norms()[0], rtol=1e-5, atol=1e-6)


def test_gram_form_over_several_tiles_drops_a_non_finite_example(gen, monkeypatch):
    """Whole examples per forward tile (two tiles here, in one reused buffer); the clipped sum
    replays those tiles and leaves out a dropped example whose hidden states are NaN."""
    monkeypatch.setattr(_kept, "available_memory", lambda device: 1024)
    monkeypatch.setenv("OPAKE_CHUNK_WORKSPACE_MB", "0.021")  # 67 rows of 41 logits
    hidden, weight, labels, grads, _ = _inputs(gen, t=30)
    h32 = hidden.float()
    h32[2, 4, 0] = float("nan")
    _, _, record = _recorded(h32, weight.float(), labels, grads.float(), None, None, route="ghost")
    assert record.kept is not None
    assert record.kept.u is None
    assert record.kept.tile == 60
    op = record.example_grads(grads.float())
    want, _ = _per_example(hidden[:2], weight, labels[:2], grads[:2], None)
    norms = op.sq_norms()[0]
    assert not torch.isfinite(norms[2])
    torch.testing.assert_close(norms[:2].double(), want.square().sum((1, 2)), rtol=1e-5, atol=1e-7)
    got, _ = op.weighted_sum(torch.ones(3), torch.tensor([True, True, False]))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want.sum(0), rtol=1e-5, atol=1e-6)
