"""The certified bounds against an exact oracle, piece by piece.

For every kind of piece (a layer's ``OuterSum`` on the Gram and the materialised route, an
embedding's one-hot ``OuterSum``, a ``Dense``) and pairs of pieces of one parameter, with inputs
generated to break floating point — subnormal and flushed values, values near ``√FLT_MAX``,
cancelling and repeated tokens, long reductions whose ties round-half-to-even absorbs, mixed
scales across tokens — hypothesis checks each claim of the proof (docs/guide/clipping-proof.md)
against exact rational arithmetic (``fractions.Fraction`` of the fp32 values) on small shapes:

- ``|sq − ‖G‖²| ≤ err`` (Lemmas 4, 5 and 1): the certified squared norm;
- ``‖added − w·G‖ ≤ w·rel + abs`` for the tensor the clipped sum really receives (Lemmas 6, 7),
  for random clip factors, with the other examples masked;
- ``‖added_leaf‖ ≤ w·bound + slack`` for a whole leaf (tied uses included).

Each runs with flush-to-zero and denormals-are-zero off and on.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opake.dpsgd.bookkeeping._certify import certify, inner, leaf_bounds
from opake.dpsgd.bookkeeping._pieces import Dense, OuterSum, add_weighted
from opake.dpsgd.certify import full_precision

SETTINGS = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,  # the flush mode is meant to hold for all inputs
    ],
)

#: exponents (base 2) of the generated values: subnormal, tiny, ordinary, near √FLT_MAX
SCALES = st.sampled_from([-140, -130, -100, -60, -12, 0, 12, 60, 62, 63])
#: clip factors k·2⁻²⁰ (hypothesis cannot draw floats while denormals are flushed)
FACTOR = st.integers(0, 2**20)
PATTERNS = st.sampled_from(["random", "repeated", "alternating", "cancelling", "ties", "mixed"])


def _tokens(gen: torch.Generator, steps: int, width: int, pattern: str, scale: int):
    base = torch.randn(steps, width, generator=gen, dtype=torch.float64)
    if pattern == "repeated":
        base = base[:1].expand(steps, width).clone()
    elif pattern == "alternating":
        sign = torch.tensor([(-1.0) ** t for t in range(steps)], dtype=torch.float64)
        base = base[:1] * sign[:, None]
    elif pattern == "cancelling":
        base[1::2] = -base[0 : steps - steps % 2 : 2] * (1 + 2.0**-20)
    elif pattern == "ties":  # one 1.0, the rest ±2⁻¹²: sums of many exact ties
        base = torch.full((steps, width), 2.0**-12, dtype=torch.float64)
        base *= torch.randint(0, 2, (steps, width), generator=gen).double() * 2 - 1
        base[:, 0] = 1.0
    elif pattern == "mixed":  # scales across tokens spanning the whole range
        base *= 2.0 ** torch.randint(-40, 40, (steps, 1), generator=gen).double()
    return (base * 2.0**scale).float()


def _exact_outer(a: torch.Tensor, b: torch.Tensor, index: int) -> list[list[Fraction]]:
    """Example ``index``'s gradient ``Σ_t a_t b_tᵀ`` in exact rationals."""
    fa = [[Fraction(float(v)) for v in row] for row in a[index].tolist()]
    fb = [[Fraction(float(v)) for v in row] for row in b[index].tolist()]
    rows, cols = len(fa[0]), len(fb[0])
    return [
        [sum(fa[t][r] * fb[t][c] for t in range(len(fa))) for c in range(cols)] for r in range(rows)
    ]


def _sq(matrix: list[list[Fraction]]) -> Fraction:
    return sum((v * v for row in matrix for v in row), Fraction(0))


def _exact_norm_of(t: torch.Tensor) -> Fraction:
    return sum((Fraction(float(v)) ** 2 for v in t.double().flatten().tolist()), Fraction(0))


def _within(value: float, err: float, exact: Fraction) -> bool:
    if not (math.isfinite(value) and math.isfinite(err)):
        return True  # a non-finite certificate: the example contributes nothing
    return abs(Fraction(value) - exact) <= Fraction(err)


@pytest.fixture(params=[False, True], ids=["ieee", "ftz-daz"])
def flush(request):
    """Each property with denormals kept, then flushed (conftest's ``flush_denormal``)."""
    if request.param:
        request.getfixturevalue("flush_denormal")
    return request.param


def _piece(gen, steps, rows, cols, pa, pb, sa, sb, indexed=False):
    b = torch.stack([_tokens(gen, steps, cols, pb, sb) for _ in range(2)])
    if indexed:
        ids = torch.randint(0, rows, (2, steps), generator=gen)
        if pa in ("repeated", "alternating", "cancelling"):
            ids[:] = ids[:, :1]
        return OuterSum(ids, b, rows=rows)
    a = torch.stack([_tokens(gen, steps, rows, pa, sa) for _ in range(2)])
    return OuterSum(a, b)


def _dense_of(piece: OuterSum) -> torch.Tensor:
    if piece.indexed:
        return torch.nn.functional.one_hot(piece.a, piece.shape[0]).float()
    return piece.a


CASE = st.tuples(
    st.integers(1, 6),  # tokens
    st.integers(1, 4),  # rows
    st.integers(1, 4),  # cols
    PATTERNS,
    PATTERNS,
    SCALES,
    SCALES,
    st.booleans(),  # an embedding (one-hot a)
    st.integers(0, 2**16),
)


@SETTINGS
@given(case=CASE, k=FACTOR)
def test_a_piece_certificate_and_its_sum_hold_exactly(flush, case, k):
    w = k * 2.0**-20
    steps, rows, cols, pa, pb, sa, sb, indexed, seed = case
    gen = torch.Generator().manual_seed(seed)
    piece = _piece(gen, steps, rows, cols, pa, pb, sa, sb, indexed)
    with full_precision():
        cert = certify(piece)
        weights = torch.tensor([w, 0.7], dtype=torch.float32)
        keep = torch.tensor([True, False])  # example 0 alone: example 1 adds exact zeros
        added = torch.zeros(rows, cols)
        add_weighted(piece, weights, keep, added)
    exact = _exact_outer(_dense_of(piece), piece.b, 0)
    assert _within(float(cert.sq[0]), float(cert.err[0]), _sq(exact))
    wf = Fraction(float(weights[0]))
    diff = sum(
        (
            (Fraction(float(added[r, c])) - wf * exact[r][c]) ** 2
            for r in range(rows)
            for c in range(cols)
        ),
        Fraction(0),
    )
    limit = float(weights[0]) * float(cert.rel[0]) + float(cert.abs[0])
    if math.isfinite(limit):
        assert diff <= Fraction(limit) ** 2, (float(diff) ** 0.5, limit)


@SETTINGS
@given(case=CASE, other=CASE)
def test_cross_terms_of_tied_uses_are_certified(flush, case, other):
    steps, rows, cols, pa, pb, sa, sb, indexed, seed = case
    gen = torch.Generator().manual_seed(seed)
    u = _piece(gen, steps, rows, cols, pa, pb, sa, sb, indexed)
    s2, _, _, qa, qb, ta, tb, ind2, _ = other
    v = _piece(gen, s2, rows, cols, qa, qb, ta, tb, ind2)
    with full_precision():
        value, err = inner(u, v, certify(u), certify(v))
    gu = _exact_outer(_dense_of(u), u.b, 0)
    gv = _exact_outer(_dense_of(v), v.b, 0)
    exact = sum((gu[r][c] * gv[r][c] for r in range(rows) for c in range(cols)), Fraction(0))
    assert _within(float(value[0]), float(err[0]), exact)


@SETTINGS
@given(case=CASE, k=FACTOR, dense_scale=SCALES)
def test_a_leaf_of_several_pieces_adds_at_most_its_bound(flush, case, k, dense_scale):
    """A parameter read by a layer (OuterSum), an embedding-like use and a Dense use: the tensor
    the leaf's sum receives is within ``w·bound + slack``."""
    w = k * 2.0**-20
    steps, rows, cols, pa, pb, sa, sb, indexed, seed = case
    gen = torch.Generator().manual_seed(seed)
    first = _piece(gen, steps, rows, cols, pa, pb, sa, sb, indexed)
    second = _piece(gen, max(1, steps - 1), rows, cols, pb, pa, sb, sa, not indexed)
    dense = Dense(torch.randn(2, rows, cols, generator=gen) * 2.0**dense_scale)
    pieces = [first, second, dense]
    weights = torch.tensor([w, 0.3], dtype=torch.float32)
    keep = torch.tensor([True, False])
    with full_precision():
        leaf = leaf_bounds(pieces, rows * cols)
        added = torch.zeros(rows, cols)
        for piece in pieces:
            add_weighted(piece, weights, keep, added)
    limit = float(weights[0]) * float(leaf.bound[0]) + float(leaf.slack[0])
    if math.isfinite(limit) and bool(torch.isfinite(added).all()):
        assert _exact_norm_of(added) <= Fraction(limit) ** 2


@pytest.mark.parametrize("width", [65536])
def test_long_reductions_of_ties_are_certified(width):
    """in_features 65 536 of exact ties (the Gram route's blocked reduction) and T = 4096 tokens
    (the materialised route's reduction over tokens), against fp64 of exact products."""
    small = torch.full((width - 1,), 2.0**-12)
    x = torch.stack([torch.cat([torch.ones(1), small]), torch.cat([torch.ones(1), -small])])
    piece = OuterSum(torch.tensor([[[1.0, -1.0], [-1.0, 1.0]]]), x[None])  # Gram route
    cert = certify(piece)
    g = torch.einsum("tr,tc->rc", piece.a[0].double(), piece.b[0].double())  # exact products
    exact = float(g.square().sum())
    assert abs(float(cert.sq[0]) - exact) <= float(cert.err[0]) + 1e-12 * exact
    gen = torch.Generator().manual_seed(0)
    steps = 4096
    a = torch.where(torch.rand(1, steps, 2, generator=gen) < 0.5, 1.0, -1.0) * 2.0**-12
    a[0, 0] = 1.0
    b = torch.ones(1, steps, 3)
    long = OuterSum(a, b)  # T = 4096 > R·C/(R + C): materialised
    cert = certify(long)
    g = torch.einsum("tr,tc->rc", a[0].double(), b[0].double())
    exact = float(g.square().sum())
    assert abs(float(cert.sq[0]) - exact) <= float(cert.err[0]) + 1e-12 * exact
