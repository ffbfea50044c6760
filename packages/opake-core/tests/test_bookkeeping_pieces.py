"""The norm identities of the book-keeping engine on random shapes (float64 oracle)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opake.dpsgd.bookkeeping._certify import certify, inner
from opake.dpsgd.bookkeeping._pieces import (
    Dense,
    OuterSum,
    add_weighted,
    ghost_is_cheaper,
    materialise,
    weighted_sum,
)

shapes = st.tuples(
    st.integers(1, 3),  # batch
    st.integers(1, 64),  # T
    st.integers(1, 64),  # d (rows)
    st.integers(1, 64),  # p (cols)
    st.integers(0, 2**31 - 1),  # seed
)


def _oracle(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-example gradients by an explicit loop over t, in float64."""
    out = torch.zeros(a.shape[0], a.shape[2], b.shape[2], dtype=torch.float64)
    for t in range(a.shape[1]):
        out += a[:, t, :, None].double() * b[:, t, None, :].double()
    return out


def _within(got: torch.Tensor, err: torch.Tensor, want: torch.Tensor) -> None:
    """``|got − want| ≤ err`` (the certificate's claim), up to the oracle's own fp64 rounding."""
    slack = 1e-12 * want.abs() + 1e-300
    assert bool(((got.double() - want).abs() <= err + slack).all()), (got, err, want)


@settings(max_examples=40, deadline=None)
@given(shapes)
def test_ghost_and_materialised_norms_are_certified(shape):
    batch, steps, rows, cols, seed = shape
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(batch, steps, rows, generator=gen)
    b = torch.randn(batch, steps, cols, generator=gen)
    want = _oracle(a, b).square().sum(dim=(1, 2))
    piece = OuterSum(a, b)
    cert = certify(piece)  # whichever route ghost_is_cheaper picks
    _within(cert.sq, cert.err, want)
    torch.testing.assert_close(cert.sq, want, rtol=1e-4, atol=1e-4)
    direct = materialise(piece).double().square().sum(dim=(1, 2))
    torch.testing.assert_close(direct, want, rtol=1e-4, atol=1e-4)


@settings(max_examples=30, deadline=None)
@given(shapes, st.integers(1, 64))
def test_embedding_index_matching_and_cross_terms(shape, steps2):
    batch, steps, rows, cols, seed = shape
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rows, (batch, steps), generator=gen)
    e = torch.randn(batch, steps, cols, generator=gen)
    onehot = torch.nn.functional.one_hot(ids, rows).float()
    emb = OuterSum(ids, e, rows=rows)
    dense_emb = OuterSum(onehot, e)
    lin = OuterSum(
        torch.randn(batch, steps2, rows, generator=gen),
        torch.randn(batch, steps2, cols, generator=gen),
    )
    g_emb, g_lin = _oracle(onehot, e), _oracle(lin.a, lin.b)
    # ‖G_emb‖², ⟨G_emb, G_lin⟩ (the tied-weight cross term), and the same with a Dense side
    cert = certify(emb)
    _within(cert.sq, cert.err, g_emb.square().sum(dim=(1, 2)))
    cross = (g_emb * g_lin).sum(dim=(1, 2))
    dense_g_emb, dense_g_lin = Dense(g_emb.float()), Dense(g_lin.float())
    pairs = (
        (emb, lin, cross),
        (lin, emb, cross),
        (dense_emb, lin, cross),
        (dense_g_emb, lin, (dense_g_emb.g.double() * g_lin).sum(dim=(1, 2))),
        (emb, dense_g_lin, (g_emb * dense_g_lin.g.double()).sum(dim=(1, 2))),
    )
    for u, v, want in pairs:
        got, err = inner(u, v, certify(u), certify(v))
        _within(got, err, want)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(materialise(emb).double(), g_emb, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(shapes)
def test_weighted_sum_is_the_clipped_sum(shape):
    batch, steps, rows, cols, seed = shape
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(batch, steps, rows, generator=gen)
    b = torch.randn(batch, steps, cols, generator=gen)
    ids = torch.randint(0, rows, (batch, steps), generator=gen)
    w = torch.rand(batch, generator=gen)
    keep = torch.rand(batch, generator=gen) > 0.3
    b_bad = b.clone()
    b_bad[~keep] = float("nan")  # a dropped example's pieces never leak into the sum
    wk = torch.where(keep, w, 0.0).double()
    want = torch.einsum("b,brc->rc", wk, _oracle(a, b))
    got = weighted_sum(OuterSum(a, b_bad), w, keep).double()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    onehot = torch.nn.functional.one_hot(ids, rows).float()
    want_emb = torch.einsum("b,brc->rc", wk, _oracle(onehot, b))
    got_emb = weighted_sum(OuterSum(ids, b_bad, rows=rows), w, keep).double()
    torch.testing.assert_close(got_emb, want_emb, rtol=1e-4, atol=1e-4)
    dense = torch.where(keep[:, None], torch.randn(batch, cols, generator=gen), float("inf"))
    torch.testing.assert_close(
        weighted_sum(Dense(dense), w, keep).double(),
        torch.einsum("b,bc->c", wk, torch.where(keep[:, None], dense, 0.0).double()),
        rtol=1e-5,
        atol=1e-6,
    )


@settings(max_examples=30, deadline=None)
@given(shapes, st.sampled_from(["outer", "indexed", "dense", "outer64"]), st.floats(1e-3, 1e3))
def test_add_weighted_adds_in_place_and_each_example_stays_within_the_bound(shape, kind, clip):
    """The in-place clipped sum: ``out`` (already holding other chunks' sums) gains exactly
    ``Σ_i w_i G_i``; a dropped example's NaN never reaches it; and with the clip factors of
    the per-example loop's norms, every single example moves ``out`` by at most ``C``."""
    batch, steps, rows, cols, seed = shape
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(batch, steps, rows, generator=gen) * 10.0 ** torch.randint(-3, 4, (1,)).item()
    b = torch.randn(batch, steps, cols, generator=gen)
    ids = torch.randint(0, rows, (batch, steps), generator=gen)
    if kind == "indexed":
        a = torch.nn.functional.one_hot(ids, rows).float()
    per_example = _oracle(a, b)  # [B, R, C] float64
    if kind == "outer":
        piece = OuterSum(a, b)
    elif kind == "outer64":  # fp64 pieces into the fp32 running sum
        piece = OuterSum(a.double(), b.double())
    elif kind == "indexed":
        piece = OuterSum(ids, b, rows=rows)
    else:
        piece = Dense(per_example.float())
    norms = per_example.square().sum(dim=(1, 2)).sqrt()
    factor = (clip / norms.clamp(min=1e-30)).clamp(max=1.0).float()
    keep = torch.rand(batch, generator=gen) > 0.3
    start = torch.randn(rows, cols, generator=gen)
    out = start.clone()
    ptr = out.data_ptr()
    add_weighted(piece, factor, keep, out)
    assert out.data_ptr() == ptr
    assert out.dtype == torch.float32
    want = torch.einsum("b,brc->rc", torch.where(keep, factor, 0.0).double(), per_example)
    torch.testing.assert_close(out.double() - start.double(), want, rtol=1e-4, atol=1e-3 * clip)
    for i in range(batch):  # one example at a time: never more than C (fp32 rounding aside)
        alone = torch.zeros(rows, cols)
        add_weighted(piece, factor, torch.arange(batch) == i, alone)
        assert float(alone.double().norm()) <= clip * (1.0 + 1e-4)
    if kind != "dense":  # a dropped example's non-finite pieces contribute exactly zero
        bad = b.clone()
        bad[~keep] = float("nan")
        poisoned = OuterSum(ids if kind == "indexed" else a, bad, rows=piece.rows)
        if kind == "outer64":
            poisoned = OuterSum(a.double(), bad.double())
        out2 = start.clone()
        add_weighted(poisoned, factor, keep, out2)
        assert bool(torch.isfinite(out2).all())
        torch.testing.assert_close(out2, out, rtol=1e-5, atol=1e-5 * max(1.0, clip))


def test_mixopt_crossover():
    # ghost while T·(d + p) ≤ d·p: a 256 × 256 layer switches to materialised above T = 128,
    # a 256 × 4096 (lm_head-shaped) one above T = 240
    assert ghost_is_cheaper(128, 256, 256)
    assert not ghost_is_cheaper(129, 256, 256)
    assert ghost_is_cheaper(240, 256, 4096)
    assert not ghost_is_cheaper(241, 256, 4096)
    assert not ghost_is_cheaper(1, 1, 2)  # T·3 > 2: a 1 × 2 gradient is cheaper to form
