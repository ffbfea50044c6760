"""Per-example gradient pieces of the book-keeping engine and their algebra (all in fp32).

A layer use leaves one *piece* per parameter it touches:

- :class:`OuterSum` — the per-example gradient is ``G_i = Σ_t a_{i,t} ⊗ b_{i,t}`` (an
  ``[R, C]`` matrix): a linear map over a sequence (``a`` = output grads, ``b`` = inputs), the
  transposed ``Conv1D`` of GPT-2, or an embedding (``a`` = one-hot token ids, held as indices).
- :class:`Dense` — the per-example gradient itself, ``[B, *shape]`` (biases, norm weights,
  per-layer fallbacks).
- :class:`Implicit` — per-example gradients held by an operator that computes norms, weighted
  sums and inner products itself (:class:`ImplicitGrad`; e.g. the output projection inside a
  loss-only linear cross-entropy, whose logit gradients never exist as one tensor, or a stack
  ``[E, R, C]`` of fused experts' weights, each example's held as its routed slots).

From pieces the engine needs their certified norms (:mod:`._certify`, on the Gram matrices of
:func:`gram_a` and :func:`opake.dpsgd.certify.gram`, or the materialised gradient of
:func:`materialise`) — the sum over all pairs of uses of a parameter, so tied weights (one matrix
used as embedding and ``lm_head``) get the cross term; :func:`ghost_is_cheaper` picks the route
per layer (like fastDP's MixOpt, by multiply-adds) — and the clipped sum ``Σ_i c_i G_i``
(:func:`weighted_sum`): one contraction over batch × time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

__all__ = [
    "Dense",
    "Implicit",
    "ImplicitGrad",
    "OuterSum",
    "Piece",
    "add_weighted",
    "example_rows",
    "ghost_is_cheaper",
    "gram_a",
    "materialise",
    "weighted_sum",
]


@dataclass(frozen=True)
class OuterSum:
    """``G_i = Σ_t a[i, t] ⊗ b[i, t]``; ``a`` is ``[B, T, R]`` or int64 ids ``[B, T]`` (one-hot).

    >>> import torch
    >>> piece = OuterSum(torch.ones(1, 2, 3), torch.ones(1, 2, 4))
    >>> piece.shape, materialise(piece).square().sum().item()
    ((3, 4), 48.0)
    """

    a: torch.Tensor
    b: torch.Tensor
    rows: int | None = None  # number of rows R when ``a`` holds indices (an embedding)

    @property
    def shape(self) -> tuple[int, int]:
        """The parameter's shape ``(R, C)``."""
        rows = self.rows if self.rows is not None else int(self.a.shape[-1])
        return rows, int(self.b.shape[-1])

    @property
    def indexed(self) -> bool:
        """True when ``a`` holds indices (an embedding lookup)."""
        return self.rows is not None


@dataclass(frozen=True)
class Dense:
    """The per-example gradients themselves, ``[B, *shape]``.

    >>> import torch
    >>> Dense(torch.tensor([[3.0, 4.0]])).g.shape
    torch.Size([1, 2])
    """

    g: torch.Tensor


@runtime_checkable
class ImplicitGrad(Protocol):
    """Per-example gradients ``G_i`` of one parameter that an operator never forms: an
    ``[R, C]`` matrix, or a stack of them (``[E, R, C]``).

    ``opake.kernels.linear_cross_entropy_example_grads`` returns one (the output projection
    inside a linear cross-entropy, ``[V, H]``); opake-models' fused experts another
    (``[E, R, C]``). All results are fp32 ``[B]`` unless stated.
    """

    @property
    def batch(self) -> int:
        """Number of examples ``B``."""
        ...

    @property
    def shape(self) -> tuple[int, ...]:
        """The parameter's shape: ``(R, C)``, or ``(E, R, C)`` for a stack of matrices."""
        ...

    def sq_norms(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(‖G_i‖², squared norms of an attached bias or None)``."""
        ...

    def weighted_sum(
        self, weights: torch.Tensor, keep: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(Σ_i w_i G_i, the bias's or None)``, the sum in the parameter's shape; rows not
        kept contribute zero."""
        ...

    def inner_outer(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``⟨G_i, Σ_s a_s ⊗ b_s⟩`` for an ``[R, C]`` matrix (the engine asks only when an
        :class:`OuterSum` use of the same shape shares the parameter): ``a`` int64 row ids
        ``[B, S]`` or ``[B, S, R]``, ``b`` ``[B, S, C]``."""
        ...

    def abs_norms(self) -> torch.Tensor:
        """``Σ_t ‖d_{i,t}‖ ‖h_{i,t}‖`` ``[B]`` (fp64) when ``G_i = Σ_t d_{i,t} h_{i,t}ᵀ``: an
        upper bound of ``‖G_i‖`` that no cancellation shrinks (the scale of the rounding error
        of every Gram-based result; see :mod:`opake.dpsgd.bookkeeping._certify`)."""
        ...

    def example_rows(self, index: int, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of example ``index``'s gradient ``G_index`` along its first
        dimension, each flattened, fp64 (``[rows, C]`` for a matrix, ``[rows, R·C]`` for a
        stack), computed the same way on every call (the exact route of the certified
        clipping)."""
        ...


@dataclass(frozen=True)
class Implicit:
    """A parameter's per-example gradients held by an :class:`ImplicitGrad` operator."""

    op: ImplicitGrad

    @property
    def shape(self) -> tuple[int, ...]:
        """The parameter's shape (the operator's: ``(R, C)`` or ``(E, R, C)``)."""
        return self.op.shape


Piece = OuterSum | Dense | Implicit


def _f32(x: torch.Tensor) -> torch.Tensor:
    import torch

    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def ghost_is_cheaper(steps: int, rows: int, cols: int) -> bool:
    """Whether the Gram ("ghost") norm costs fewer multiply-adds than the materialised one.

    Per example the Gram route costs ``T²·(R + C)`` (two ``T × T`` Gram matrices), the
    materialised route ``T·R·C`` (the ``R × C`` gradient): ghost while ``T·(R + C) ≤ R·C``,
    i.e. up to ``T* = R·C / (R + C)``. Timed on CPU (``tools/bench/bk_crossover.py``,
    ``docs/benchmarks.md``) this lands within 1.05–1.4× of the measured crossover for square and
    rectangular layers, where MixOpt's memory rule ``2T² ≤ R·C`` switched 1.1–2.1× too late. It
    also never costs memory: below ``T*`` the Gram route's ``2T²`` numbers are at most
    ``R·C / 2``.

    >>> ghost_is_cheaper(64, 256, 256), ghost_is_cheaper(512, 64, 64)
    (True, False)
    >>> ghost_is_cheaper(128, 256, 256), ghost_is_cheaper(129, 256, 256)  # T* = 128
    (True, False)
    """
    return steps * (rows + cols) <= rows * cols


def materialise(piece: OuterSum, *, wide: bool = False) -> torch.Tensor:
    """``[B, R, C]`` per-example gradients of an :class:`OuterSum` (fp32: one product over each
    example's tokens; ``wide``: in fp64, where products of fp32 numbers are exact)."""
    import torch

    wide = wide or torch.float64 in (piece.a.dtype, piece.b.dtype)
    b = piece.b.double() if wide else _f32(piece.b)
    if not piece.indexed:
        a = piece.a.double() if wide else _f32(piece.a)
        return torch.einsum("btr,btc->brc", a, b)
    batch, _, cols = b.shape
    rows = int(piece.rows or 0)
    out = torch.zeros(batch, rows, cols, dtype=b.dtype, device=b.device)
    return out.scatter_add_(1, piece.a[:, :, None].expand(-1, -1, cols), b)


def gram_a(u: OuterSum, v: OuterSum) -> torch.Tensor:
    """``[B, T_u, T_v]`` fp64 matrix of ``a_t · a'_s``: exact for one-hot (index) sides, else the
    certified blocked Gram of :func:`opake.dpsgd.certify.gram`.

    >>> import torch
    >>> u = OuterSum(torch.tensor([[1, 2]]), torch.ones(1, 2, 2), rows=3)
    >>> gram_a(u, u)[0].tolist()
    [[1.0, 0.0], [0.0, 1.0]]
    """
    import torch

    from opake.dpsgd.certify import gram

    if u.indexed and v.indexed:
        return (u.a[:, :, None] == v.a[:, None, :]).to(torch.float64)
    if u.indexed:
        # a_t is one-hot at u.a[t]: a_t · a'_s = a'_s[u.a[t]] (a gather: no rounding)
        dense = v.a  # [B, S, R]
        idx = u.a[:, None, :].expand(-1, dense.shape[1], -1)  # [B, S, T]
        return torch.gather(dense, 2, idx).transpose(1, 2).double()
    if v.indexed:
        return gram_a(v, u).transpose(1, 2)
    return gram(u.a, v.a)


def weighted_sum(piece: Piece, weights: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``Σ_i w_i G_i`` (fp32, the parameter's shape for an OuterSum, ``shape`` for a Dense).

    Rows with ``keep[i]`` false contribute exactly zero even when their pieces are NaN/Inf
    (``keep=None``: every row is finite and kept, which skips the masking copies).

    >>> import torch
    >>> piece = OuterSum(torch.ones(2, 1, 2), torch.ones(2, 1, 3))
    >>> weighted_sum(piece, torch.tensor([1.0, 0.5]), torch.tensor([True, False])).tolist()
    [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    """
    import torch

    if isinstance(piece, Implicit):
        return piece.op.weighted_sum(_f32(weights), keep)[0].float()
    shape = tuple(piece.g.shape[1:]) if isinstance(piece, Dense) else piece.shape
    out = torch.zeros(shape, dtype=_wide(piece), device=weights.device)
    add_weighted(piece, weights, keep, out)
    return out


def _wide(piece: OuterSum | Dense) -> torch.dtype:
    """The dtype the weighted sum of ``piece`` is computed in (fp64 pieces stay fp64)."""
    import torch

    if isinstance(piece, Dense):
        return _f32(piece.g).dtype
    if piece.indexed:
        return _f32(piece.b).dtype
    return torch.promote_types(_f32(piece.a).dtype, _f32(piece.b).dtype)


def add_weighted(
    piece: Piece, weights: torch.Tensor, keep: torch.Tensor | None, out: torch.Tensor
) -> None:
    """``out += Σ_i w_i G_i`` in place: one matrix product over all examples' tokens for an
    OuterSum (no per-example loop, no temporary of the parameter's size), one matrix-vector
    product for a Dense.

    ``out`` is a contiguous fp32 tensor with the parameter's elements (any shape of that
    size). Rows with ``keep[i]`` false contribute exactly zero, as in :func:`weighted_sum`.

    >>> import torch
    >>> out = torch.ones(2, 3)
    >>> add_weighted(OuterSum(torch.ones(2, 1, 2), torch.ones(2, 1, 3)), torch.ones(2), None, out)
    >>> out.tolist()
    [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]
    """
    import torch

    if isinstance(piece, Implicit):
        out += piece.op.weighted_sum(_f32(weights), keep)[0].float().reshape(out.shape)
        return
    wide = _wide(piece)
    if out.dtype != wide:  # e.g. fp64 pieces into an fp32 sum: form, then add
        out += weighted_sum(piece, weights, keep).reshape(out.shape)
        return
    w = _f32(weights).to(wide)
    if keep is not None:
        w = torch.where(keep, w, 0.0)
    if isinstance(piece, Dense):
        g = _f32(piece.g).reshape(piece.g.shape[0], -1)
        if keep is not None:
            g = torch.where(keep[:, None], g, 0.0)
        out.view(-1).addmv_(g.T, w)
        return
    b = _f32(piece.b)
    if keep is not None:
        b = torch.where(keep[:, None, None], b, 0.0)
    rows, cols = piece.shape
    flat = out.view(rows, cols)
    if piece.indexed:
        flat.index_add_(0, piece.a.reshape(-1), (b * w[:, None, None]).reshape(-1, cols))
        return
    a = _f32(piece.a)
    if keep is not None:
        a = torch.where(keep[:, None, None], a, 0.0)
    if a.shape[-1] < cols:  # scale the narrower factor by the weights (fewer products)
        a = a * w[:, None, None]
    else:
        b = b * w[:, None, None]
    flat.addmm_(a.reshape(-1, rows).T, b.reshape(-1, cols))


def example_rows(piece: Piece, index: int, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of example ``index``'s gradient as fp64 ``[rows, C]``.

    The parameter is viewed as ``[R, C]`` (a vector as ``[R, 1]``). Products of fp32 numbers
    are exact in fp64, so only the sum over tokens rounds, at fp64 precision.

    >>> import torch
    >>> piece = OuterSum(torch.tensor([[0, 2, 0]]), torch.ones(1, 3, 2), rows=3)
    >>> example_rows(piece, 0, 0, 3).tolist()
    [[2.0, 2.0], [0.0, 0.0], [1.0, 1.0]]
    """
    import torch

    if isinstance(piece, Implicit):
        return piece.op.example_rows(index, start, stop).double()
    if isinstance(piece, Dense):
        g = piece.g[index]
        return g.reshape(g.shape[0] if g.dim() else 1, -1)[start:stop].double()
    b = piece.b[index].double()
    if not piece.indexed:
        return piece.a[index, :, start:stop].double().T @ b
    ids = piece.a[index]
    inside = (ids >= start) & (ids < stop)
    out = torch.zeros(stop - start, b.shape[1], dtype=torch.float64, device=b.device)
    return out.index_add_(0, ids[inside] - start, b[inside])
