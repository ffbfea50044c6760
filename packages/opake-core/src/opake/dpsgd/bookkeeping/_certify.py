"""Certified clipping for the book-keeping engine: per-leaf bounds no input can break.

For every example ``i`` and differentiated leaf ``j`` the engine needs ``bound_ij`` and
``slack_ij`` with ``‖added_ij‖ ≤ w·bound_ij + slack_ij`` for every clip factor ``w ∈ [0, 1]``,
where ``added_ij`` is the fp32 tensor the clipped sum receives for that example (isolated: the
other examples masked). The pieces (:mod:`._pieces`) of the leaf give, per example:

- a **certificate** per piece (:class:`PieceCert`): the computed squared norm ``sq``, a bound
  ``err`` of its distance to the true squared norm of the piece's gradient (the Gram route's
  :func:`~opake.dpsgd.certify.error_bound`, or the materialised route's rounding), and
  ``(rel, abs)`` of the way the piece is added (:func:`~opake.dpsgd.certify.contraction_error`,
  :func:`~opake.dpsgd.certify.scaled_add_error`);
- an **inner product** with its error bound for every pair of pieces of the leaf (tied
  weights: an embedding and an output head);

and :func:`leaf_bounds` combines them:
``bound = (√(max(Σ sq + 2Σ inner, 0) + Σ err + 2Σ err_inner) + Σ rel + mix)·FINAL``
(``mix``: rounding when a later piece is added onto an earlier one; ``FINAL``: an fp64 piece's
conversion to fp32 and the final division by ``normalize_by``). Where that bound exceeds the
computed norm by more than :data:`LOOSE` (and by enough to matter for the example's clip factor:
the runner's ``MATTERS``) the example takes the **exact route** for that leaf
(:func:`~opake.dpsgd.certify.measure_blocks` / :func:`~opake.dpsgd.certify.guarded_add`): it is
left out of the contraction and added from its materialised gradient, measured.

A piece held by an operator (:class:`~._pieces.Implicit`) is inside the proof only when the
operator certifies itself (:class:`CertifiedImplicitGrad`, implemented by Opake's own
operators); any other operator must be named in a trust list (``clipped_grad(trusted_rules=...)``
or ``OPAKE_TRUSTED_RULES``), and is then bounded by the model of the earlier releases
(:data:`LEGACY_GAMMA`), outside the proof.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from opake.core.errors import OperationError
from opake.dpsgd.bookkeeping._pieces import (
    Dense,
    Implicit,
    OuterSum,
    Piece,
    example_rows,
    ghost_is_cheaper,
    gram_a,
    materialise,
)
from opake.dpsgd.certify import (
    ETA,
    FINAL,
    SAFE,
    WIDE_MACS,
    GramCache,
    GramTerms,
    contraction_error,
    contraction_factors,
    contraction_from,
    dense_sq_norms,
    diagonal_norms,
    entry_error,
    error_bound,
    gamma32,
    gamma64,
    gram,
    scaled_add_error,
    token_norms,
    wide,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "LEGACY_GAMMA",
    "LOOSE",
    "TINY",
    "CertifiedImplicitGrad",
    "LeafBounds",
    "PieceCert",
    "certified_operator",
    "certify",
    "certify_inner",
    "exact_block",
    "finish",
    "ghost_cert",
    "leaf_bounds",
    "token_sums",
]

#: take the exact route where the certified bound exceeds the computed norm by more than this
LOOSE = 2.0**-4
#: bounds below this never take the exact route (padding and all-zero examples)
TINY = 2.0**-64
#: the rounding model of trusted, uncertified operators (outside the proof)
LEGACY_GAMMA = 8.0 * 2.0**-24


@runtime_checkable
class CertifiedImplicitGrad(Protocol):
    """An :class:`~._pieces.ImplicitGrad` operator that proves its own bounds.

    ``certificate()`` returns the operator's :class:`PieceCert` (per example: computed squared
    norm, the bound of its error, and ``(rel, abs)`` of its ``weighted_sum``);
    ``certified_inner(a, b)`` the inner product with an OuterSum use ``(a, b)`` of the same
    matrix and the bound of its error (both fp64 ``[B]``).
    """

    def certificate(self) -> PieceCert:
        """The operator's certificate (see :class:`PieceCert`)."""
        ...

    def certified_inner(
        self, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(⟨G_i, Σ_s a_s ⊗ b_s⟩, bound of its error)`` fp64 ``[B]``."""
        ...


@dataclass
class PieceCert:
    """What one piece contributes to its leaf's bound (fp64 ``[B]`` tensors).

    ``sq``: computed squared norm; ``err``: bound of ``|sq − ‖G‖²|``; ``rel``/``abs``: the
    added tensor is within ``w·rel + abs`` of ``w·G``; ``steps``: tokens per example (the
    length of its reductions); ``sums``: ``(S, Pa, Pb)`` — ``Σ_t α_tβ_t``, ``Σ_t α_t``,
    ``Σ_t β_t`` of the token-norm bounds (OuterSum pieces: for inner products with other
    pieces of the leaf).
    """

    sq: torch.Tensor
    err: torch.Tensor
    rel: torch.Tensor
    abs: torch.Tensor
    steps: int = 1
    sums: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    scale: torch.Tensor | None = None  # Σ_t ‖a_t‖‖b_t‖ (the scale of fp32 rounding), or None

    @property
    def norm_up(self) -> torch.Tensor:
        """Certified upper bound of the piece's gradient norm."""
        return (self.sq.clamp(min=0.0) + self.err).sqrt()


#: a materialised per-example gradient of at most this many multiply-adds is formed in fp64
_WIDE_MATERIALISE = WIDE_MACS >> 5


def _norms_from(g: torch.Tensor, x: torch.Tensor, d: int) -> torch.Tensor:
    """Token-norm bounds from the diagonal of ``g = gram(x)`` (free: the Gram route computed it),
    or by a pass over ``x`` where a block overflowed."""
    import torch

    out = diagonal_norms(g, d, x.dtype, wide(x))
    if not bool(torch.isfinite(out).all()):
        out = token_norms(x)
    return out


def _outer(piece: OuterSum, cache: GramCache | None) -> PieceCert:
    import torch

    rows, cols = piece.shape
    batch, steps = int(piece.b.shape[0]), int(piece.b.shape[1])
    ghost = piece.indexed or ghost_is_cheaper(steps, rows, cols)
    ga = gb = None
    if ghost:  # the token norms come off the Gram matrices' diagonals
        gb = gram(piece.b) if cache is None else cache.gram(piece.b)
        beta = _norms_from(gb, piece.b, cols)
        ga = gram_a(piece, piece)
    else:
        beta = token_norms(piece.b)
    if piece.indexed:
        alpha = torch.ones(batch, steps, dtype=torch.float64, device=beta.device)
        a_err = (0.0, 0.0)
    else:
        alpha = token_norms(piece.a) if ga is None else _norms_from(ga, piece.a, rows)
        a_err = entry_error(rows, piece.a.dtype, wide(piece.a))
    b_err = entry_error(cols, piece.b.dtype, wide(piece.b))
    factors = contraction_factors(steps=steps, rows=batch * steps, shape=(rows, cols))
    if ga is not None and gb is not None:
        sq, err, rel, abs_, (s, pa, pb) = ghost_cert(
            ga, gb, alpha, beta, factors=factors, a_err=a_err, b_err=b_err
        )
    else:  # materialised (in fp64 when tiny): its distance to G is a contraction over T
        s, pa, pb = token_sums(alpha, beta)
        rel, abs_ = contraction_from(s, pa, pb, factors)
        small = batch * steps * rows * cols <= _WIDE_MATERIALISE
        g = materialise(piece, wide=small)
        sq, up = dense_sq_norms(g.reshape(batch, -1))
        del g
        if small:  # products exact, sums in fp64; subnormal inputs may be read as zero
            d_rel = s * gamma64(steps + 2) + (pa * math.sqrt(cols) + pb * math.sqrt(rows)) * ETA
            d_abs = torch.zeros_like(d_rel)
        else:
            d_rel, d_abs = contraction_error(s, pa, pb, steps=steps, rows=steps, shape=(rows, cols))
        norm = up.sqrt() + d_rel + d_abs
        err = (norm.square() - sq).clamp(min=0.0) * (1.0 + SAFE)
    return PieceCert(sq, err, rel, abs_, steps, (s, pa, pb), s)


def token_sums(alpha: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Upper bounds of ``(S, Pa, Pb) = (Σ_t α_tβ_t, Σ_t α_t, Σ_t β_t)`` per example from
    token-norm bounds ``[B, T]``: the fp64 sums over tokens round too (``γ64(T + 2)``)."""
    widen = 1.0 + 2.0 * gamma64(int(alpha.shape[1]) + 2)
    return (alpha * beta).sum(dim=1) * widen, alpha.sum(dim=1) * widen, beta.sum(dim=1) * widen


def ghost_cert(
    ga: torch.Tensor,
    gb: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    *,
    factors: tuple[Any, Any, Any, Any],
    a_err: tuple[Any, Any],
    b_err: tuple[Any, Any],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """The Gram route's certificate of an OuterSum from its Gram matrices ``[B, T, T]`` and
    token-norm bounds ``[B, T]``: ``(sq, err, rel, abs, (S, Pa, Pb))``. Pure tensor arithmetic
    (the constants: :func:`~opake.dpsgd.certify.contraction_factors` and the two sides'
    :func:`~opake.dpsgd.certify.entry_error`, floats or fp64 0-d tensors), so a compiled
    caller (:mod:`._fused`) evaluates the very same formulas."""
    s, pa, pb = token_sums(alpha, beta)
    rel, abs_ = contraction_from(s, pa, pb, factors)
    terms = GramTerms.of((s, pa, pb), int(gb.shape[1]), a_err, b_err)
    sq = (ga * gb).sum(dim=(1, 2))
    return sq, error_bound(terms, terms), rel, abs_, (s, pa, pb)


def _dense(piece: Dense) -> PieceCert:
    g = piece.g.reshape(piece.g.shape[0], -1)
    sq, up = dense_sq_norms(g)
    import torch

    rel, abs_ = scaled_add_error(up.sqrt(), int(g.shape[1]))
    return PieceCert(sq, (up - sq).clamp(min=0.0), rel, torch.full_like(rel, abs_))


def _implicit(piece: Implicit, trusted: bool) -> PieceCert:
    op = piece.op
    if certified_operator(op):
        assert isinstance(op, CertifiedImplicitGrad)
        return op.certificate()
    if not trusted:
        raise OperationError(
            f"book-keeping: the operator {type(op).__qualname__} holds per-example gradients "
            "implicitly and does not prove its norm bounds (it is not one of Opake's own "
            "certified operators); it is outside the clipping proof. Name its rule in "
            "clipped_grad(trusted_rules=...) or OPAKE_TRUSTED_RULES to use it anyway, or use "
            "clipped_grad(engine='vmap')"
        )
    sq = op.sq_norms()[0].double()
    s = op.abs_norms().double()
    err = 2.0 * LEGACY_GAMMA * s.square() + (LEGACY_GAMMA * s).square()
    import torch

    return PieceCert(sq, err, LEGACY_GAMMA * s, torch.zeros_like(s), scale=s)


def _first_party(op: object) -> bool:
    """Operators of Opake's own distributions (their certificates are part of the proof)."""
    module = type(op).__module__
    return module.startswith(("opake.kernels.", "opake.models.", "opake.dpsgd."))


def certified_operator(op: object) -> bool:
    """Whether an implicit operator is inside the proof: one of Opake's own, certifying itself.

    >>> certified_operator(object())
    False
    """
    return isinstance(op, CertifiedImplicitGrad) and _first_party(op)


def certify(piece: Piece, cache: GramCache | None = None, *, trusted: bool = False) -> PieceCert:
    """The certificate of one piece (see the module docstring)."""
    if isinstance(piece, OuterSum):
        return _outer(piece, cache)
    if isinstance(piece, Dense):
        return _dense(piece)
    return _implicit(piece, trusted)


def _inner_outer(
    u: OuterSum, v: OuterSum, cu: PieceCert, cv: PieceCert
) -> tuple[torch.Tensor, torch.Tensor]:
    assert cu.sums is not None
    assert cv.sums is not None
    prod = gram_a(u, v).mul_(gram(u.b, v.b))
    inner = prod.sum(dim=(1, 2))
    exact_a = u.indexed or v.indexed
    rows, cols = u.shape
    a_err = (0.0, 0.0) if exact_a else entry_error(rows, u.a.dtype, wide(u.a, v.a))
    b_err = entry_error(cols, u.b.dtype, wide(u.b, v.b))
    tu = GramTerms.of(cu.sums, cu.steps, a_err, b_err)
    tv = GramTerms.of(cv.sums, cv.steps, a_err, b_err)
    return inner, error_bound(tu, tv)


def _inner_dense_outer(
    m: Dense, v: OuterSum, cm: PieceCert, cv: PieceCert
) -> tuple[torch.Tensor, torch.Tensor]:
    """``⟨M_i, Σ_t a_t ⊗ b_t⟩ = Σ_t a_t · (M_i b_t)`` in fp64 (products of fp32 numbers exact)."""
    import torch

    assert cv.sums is not None
    rows, cols = v.shape
    mat = m.g.reshape(m.g.shape[0], rows, cols).double()
    mb = torch.einsum("brc,btc->btr", mat, v.b.double())
    if v.indexed:
        inner = torch.gather(mb, 2, v.a[:, :, None]).sum(dim=(1, 2))
    else:
        inner = (mb * v.a.double()).sum(dim=(1, 2))
    n_m, (s, pa, pb) = cm.norm_up, cv.sums
    root = math.sqrt(rows * cols)
    # each term passes through the einsum's sum over ``cols`` and the final sum over the
    # ``steps·rows`` products (``steps`` gathered ones for indexed pieces): at most
    # ``cols + steps·rows`` roundings, plus the product's and the conversion's
    err = gamma64(cols + cv.steps * rows + 2) * n_m * s
    err = err + ETA * (root * s + n_m * (math.sqrt(cols) * pa + math.sqrt(rows) * pb))
    err = err + cv.steps * ETA * ETA * root * n_m
    return inner, err * (1.0 + SAFE)


def _inner_dense(u: Dense, v: Dense, cu: PieceCert, cv: PieceCert) -> tuple[torch.Tensor, ...]:
    batch = u.g.shape[0]
    gu, gv = u.g.reshape(batch, -1), v.g.reshape(batch, -1)
    n = int(gu.shape[1])
    inner = (gu.double() * gv.double()).sum(dim=1)
    nu, nv = cu.norm_up, cv.norm_up
    err = gamma64(n + 2) * nu * nv + ETA * math.sqrt(n) * (nu + nv) + n * ETA * ETA
    return inner, err * (1.0 + SAFE)


def _inner_implicit(
    u: Piece, v: Piece, cu: PieceCert, cv: PieceCert, trusted: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(v, Implicit):
        u, v, cu, cv = v, u, cv, cu
    assert isinstance(u, Implicit)
    if not isinstance(v, OuterSum) or v.shape != u.shape:
        other = type(v).__name__ if not isinstance(v, OuterSum) else f"OuterSum {v.shape}"
        raise OperationError(
            f"book-keeping: a parameter of shape {u.shape} is used both inside an operator "
            f"that holds its per-example gradients implicitly and by a {other} use; no rule "
            "forms their cross term. Use clipped_grad(engine='vmap')"
        )
    op = u.op
    if certified_operator(op):
        assert isinstance(op, CertifiedImplicitGrad)
        return op.certified_inner(v.a, v.b)
    inner = op.inner_outer(v.a, v.b).double()
    return inner, 2.0 * LEGACY_GAMMA * cu.norm_up * cv.norm_up + 0.0 * inner


def inner(
    u: Piece, v: Piece, cu: PieceCert, cv: PieceCert, *, trusted: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(⟨G_u, G_v⟩ per example, bound of its error)`` fp64 ``[B]`` for two pieces of a leaf
    (``cu``/``cv``: their certificates, :func:`certify`)."""
    if isinstance(u, Implicit) or isinstance(v, Implicit):
        return _inner_implicit(u, v, cu, cv, trusted)
    if isinstance(u, OuterSum) and isinstance(v, OuterSum):
        return _inner_outer(u, v, cu, cv)
    if isinstance(u, Dense) and isinstance(v, Dense):
        out = _inner_dense(u, v, cu, cv)
        return out[0], out[1]
    if isinstance(u, Dense):
        assert isinstance(v, OuterSum)
        return _inner_dense_outer(u, v, cu, cv)
    assert isinstance(v, Dense)
    assert isinstance(u, OuterSum)
    return _inner_dense_outer(v, u, cv, cu)


def certify_inner(u: Piece, v: Piece) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`inner` of two pieces, certifying each first (for operators that delegate their
    cross terms to an :class:`~._pieces.OuterSum` view of themselves).

    >>> import torch
    >>> u = OuterSum(torch.ones(1, 2, 3), torch.ones(1, 2, 4))
    >>> value, err = certify_inner(u, u)
    >>> float(value), bool(err[0] < 1e-9)
    (48.0, True)
    """
    return inner(u, v, certify(u), certify(v))


@dataclass
class LeafBounds:
    """One leaf's per-example results (fp64 ``[B]``): the computed squared norm (reported),
    the bound and the slack to clip with, whether the bound is loose, and how far another fp32
    computation of the gradient (plain autograd's) may stray from it by rounding alone
    (``γ32(T + 2)·Σ_t ‖a_t‖‖b_t‖``: what the check tolerates)."""

    sq: torch.Tensor
    bound: torch.Tensor
    slack: torch.Tensor
    loose: torch.Tensor
    rounding: torch.Tensor


def leaf_bounds(
    pieces: Sequence[Piece], numel: int, cache: GramCache | None = None, *, trusted: bool = False
) -> LeafBounds:
    """Combine a leaf's pieces into its :class:`LeafBounds` (see the module docstring)."""
    certs = [certify(p, cache, trusted=trusted) for p in pieces]
    sq = certs[0].sq.double()
    err = certs[0].err.double()
    for k in range(1, len(pieces)):
        sq = sq + certs[k].sq
        err = err + certs[k].err
        for j in range(k):
            value, bound = inner(pieces[j], pieces[k], certs[j], certs[k], trusted=trusted)
            sq = sq + 2.0 * value
            err = err + 2.0 * bound
    rel = sum((c.rel for c in certs[1:]), certs[0].rel)
    slack = sum((c.abs for c in certs[1:]), certs[0].abs)
    if len(certs) > 1:  # a later piece is added onto the earlier ones: that addition rounds
        mix = gamma32(max(c.steps for c in certs) + 2) * (len(certs) - 1)
        rel = rel + mix * sum((c.norm_up + c.rel for c in certs[1:]), certs[0].norm_up)
        rows = max(
            (int(p.b.shape[0] * p.b.shape[1]) for p in pieces if isinstance(p, OuterSum)),
            default=1,
        )
        slack = slack + mix * slack + len(certs) * rows * ETA * math.sqrt(numel)
    rounding = sum(
        (gamma32(c.steps + 2) * (c.norm_up if c.scale is None else c.scale) for c in certs[1:]),
        gamma32(certs[0].steps + 2)
        * (certs[0].norm_up if certs[0].scale is None else certs[0].scale),
    )
    return finish(sq, err, rel, slack, tail=ETA * math.sqrt(numel), rounding=rounding)


def finish(
    sq: torch.Tensor,
    err: torch.Tensor,
    rel: torch.Tensor,
    slack: torch.Tensor,
    *,
    tail: Any,
    rounding: torch.Tensor,
) -> LeafBounds:
    """A leaf's :class:`LeafBounds` from its summed squared norm, error bound, ``rel`` and
    slack (``tail``: ``ETA·√numel``, a float or an fp64 0-d tensor)."""
    import torch

    norm = (sq.clamp(min=0.0) + err).sqrt()
    bound = (norm + rel) * FINAL
    slack = (slack + tail) * FINAL
    computed = sq.clamp(min=0.0).sqrt()
    loose = bound > computed * (1.0 + LOOSE) + TINY
    loose = loose | (~torch.isfinite(bound) & torch.isfinite(rel))
    return LeafBounds(sq.clamp(min=0.0), bound, slack, loose, rounding)


def exact_block(pieces: Sequence[Piece], index: int, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of example ``index``'s leaf gradient: the pieces' rows summed in
    fp64 (products of fp32 numbers are exact there), rounded to fp32 once."""
    total = example_rows(pieces[0], index, start, stop)
    for piece in pieces[1:]:
        total = total + example_rows(piece, index, start, stop)
    return total.float()
