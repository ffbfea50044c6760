"""Per-example gradient pieces of the book-keeping engine and their algebra (all in fp32).

A layer use leaves one *piece* per parameter it touches:

- :class:`OuterSum` — the per-example gradient is ``G_i = Σ_t a_{i,t} ⊗ b_{i,t}`` (an
  ``[R, C]`` matrix): a linear map over a sequence (``a`` = output grads, ``b`` = inputs), the
  transposed ``Conv1D`` of GPT-2, or an embedding (``a`` = one-hot token ids, held as indices).
- :class:`Dense` — the per-example gradient itself, ``[B, *shape]`` (biases, norm weights,
  per-layer fallbacks).
- :class:`Implicit` — per-example gradients held by an operator that computes norms, weighted
  sums and inner products itself (:class:`ImplicitGrad`; e.g. the output projection inside a
  loss-only linear cross-entropy, whose logit gradients never exist as one tensor).

From pieces the engine needs two things, neither of which forms every ``G_i``:

- inner products ``⟨G_i, G'_i⟩`` for every example (:func:`inner`); a parameter's squared norm is
  the sum over all pairs of its uses, so tied weights (one matrix used as embedding and
  ``lm_head``) get the cross term. ``⟨G, G⟩`` of an :class:`OuterSum` is the ghost identity
  ``Σ_{t,s} (a_t·a_s)(b_t·b_s)`` (cost ``~T²(R+C)`` per example) or the materialised norm (cost
  ``~T·R·C``, memory ``R·C``): :func:`ghost_is_cheaper` decides per layer (like fastDP's MixOpt,
  but by multiply-adds, which the timed crossover follows);
- the clipped sum ``Σ_i c_i G_i`` (:func:`weighted_sum`): one contraction over batch × time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from opake.core.errors import OperationError

if TYPE_CHECKING:
    import torch

__all__ = [
    "Dense",
    "GramCache",
    "Implicit",
    "ImplicitGrad",
    "OuterSum",
    "abs_norm",
    "add_weighted",
    "example_rows",
    "ghost_is_cheaper",
    "inner",
    "sq_norm",
    "sq_norm_abs",
    "weighted_sum",
]


@dataclass(frozen=True)
class OuterSum:
    """``G_i = Σ_t a[i, t] ⊗ b[i, t]``; ``a`` is ``[B, T, R]`` or int64 ids ``[B, T]`` (one-hot).

    >>> import torch
    >>> piece = OuterSum(torch.ones(1, 2, 3), torch.ones(1, 2, 4))
    >>> piece.shape, sq_norm(piece).tolist()
    ((3, 4), [48.0])
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
    >>> sq_norm(Dense(torch.tensor([[3.0, 4.0]]))).tolist()
    [25.0]
    """

    g: torch.Tensor


@runtime_checkable
class ImplicitGrad(Protocol):
    """Per-example gradients ``G_i`` of one ``[R, C]`` matrix that an operator never forms.

    ``opake.kernels.linear_cross_entropy_example_grads`` returns one (the output projection
    inside a linear cross-entropy). All results are fp32 ``[B]`` unless stated.
    """

    @property
    def batch(self) -> int:
        """Number of examples ``B``."""
        ...

    @property
    def shape(self) -> tuple[int, int]:
        """The matrix's shape ``(R, C)``."""
        ...

    def sq_norms(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(‖G_i‖², squared norms of an attached bias or None)``."""
        ...

    def weighted_sum(
        self, weights: torch.Tensor, keep: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(Σ_i w_i G_i [R, C], the bias's or None)``; rows not kept contribute zero."""
        ...

    def inner_outer(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``⟨G_i, Σ_s a_s ⊗ b_s⟩``: ``a`` int64 row ids ``[B, S]`` or ``[B, S, R]``, ``b``
        ``[B, S, C]``."""
        ...

    def abs_norms(self) -> torch.Tensor:
        """``Σ_t ‖d_{i,t}‖ ‖h_{i,t}‖`` ``[B]`` (fp64) when ``G_i = Σ_t d_{i,t} h_{i,t}ᵀ``: an
        upper bound of ``‖G_i‖`` that no cancellation shrinks (the scale of the rounding error
        of every Gram-based result; see :mod:`opake.dpsgd.bookkeeping._certify`)."""
        ...

    def example_rows(self, index: int, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of example ``index``'s gradient ``G_index``, fp64 ``[rows, C]``,
        computed the same way on every call (the exact route of the certified clipping)."""
        ...


@dataclass(frozen=True)
class Implicit:
    """A matrix's per-example gradients held by an :class:`ImplicitGrad` operator."""

    op: ImplicitGrad

    @property
    def shape(self) -> tuple[int, int]:
        """The parameter's shape ``(R, C)``."""
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


def _materialise(piece: OuterSum) -> torch.Tensor:
    """``[B, R, C]`` per-example gradients of an :class:`OuterSum` (fp32)."""
    import torch

    b = _f32(piece.b)
    if not piece.indexed:
        return torch.einsum("btr,btc->brc", _f32(piece.a), b)
    batch, _, cols = b.shape
    rows = int(piece.rows or 0)
    out = torch.zeros(batch, rows, cols, dtype=b.dtype, device=b.device)
    return out.scatter_add_(1, piece.a[:, :, None].expand(-1, -1, cols), b)


def _gram_a(u: OuterSum, v: OuterSum) -> torch.Tensor:
    """``[B, T_u, T_v]`` of ``a_t · a'_s``."""
    import torch

    if u.indexed and v.indexed:
        return (u.a[:, :, None] == v.a[:, None, :]).to(_f32(u.b).dtype)
    if u.indexed:
        # a_t is one-hot at u.a[t]: a_t · a'_s = a'_s[u.a[t]]
        dense = _f32(v.a)  # [B, S, R]
        idx = u.a[:, None, :].expand(-1, dense.shape[1], -1)  # [B, S, T]
        return torch.gather(dense, 2, idx).transpose(1, 2)
    if v.indexed:
        return _gram_a(v, u).transpose(1, 2)
    return torch.bmm(_f32(u.a), _f32(v.a).transpose(1, 2))


def _inner_outer(u: OuterSum, v: OuterSum) -> torch.Tensor:
    import torch

    gram_b = torch.bmm(_f32(u.b), _f32(v.b).transpose(1, 2))
    # in place (two T × T matrices at most); the T² products summed in fp64, so that the only
    # rounding left is the Gram entries' (what the certified bound of _bk_certify covers)
    return gram_b.mul_(_gram_a(u, v)).sum(dim=(1, 2), dtype=torch.float64)


def _inner_dense_outer(m: torch.Tensor, v: OuterSum) -> torch.Tensor:
    """``⟨M_i, Σ_t a_t ⊗ b_t⟩ = Σ_t a_t · (M_i b_t)``."""
    import torch

    mb = torch.einsum("brc,btc->btr", _f32(m), _f32(v.b))  # [B, T, R]
    if v.indexed:
        return torch.gather(mb, 2, v.a[:, :, None]).sum(dim=(1, 2))
    return (mb * _f32(v.a)).sum(dim=(1, 2))


def inner(u: Piece, v: Piece) -> torch.Tensor:
    """Per-example ``⟨G_i, G'_i⟩`` ``[B]`` (fp32 or fp64) of two pieces of the same parameter.

    >>> import torch
    >>> u = OuterSum(torch.tensor([[1, 2]]), torch.ones(1, 2, 2), rows=3)  # embedding
    >>> v = OuterSum(torch.ones(1, 1, 3), torch.ones(1, 1, 2))  # a linear use
    >>> inner(u, v).tolist(), inner(u, Dense(_materialise(v))).tolist()
    ([4.0], [4.0])
    """
    if isinstance(u, Implicit) or isinstance(v, Implicit):
        return _inner_implicit(u, v)
    if isinstance(u, Dense) and isinstance(v, Dense):
        batch = u.g.shape[0]
        return (_f32(u.g).reshape(batch, -1) * _f32(v.g).reshape(batch, -1)).sum(dim=1)
    if isinstance(u, Dense):
        assert isinstance(v, OuterSum)
        return _inner_dense_outer(u.g.reshape(u.g.shape[0], *v.shape), v)
    if isinstance(v, Dense):
        return inner(v, u)
    return _inner_outer(u, v)


def _inner_implicit(u: Piece, v: Piece) -> torch.Tensor:
    """``⟨G_i, G'_i⟩`` when one side is an :class:`Implicit` (the other must be an OuterSum)."""
    if isinstance(v, Implicit):
        u, v = v, u
    assert isinstance(u, Implicit)
    if not isinstance(v, OuterSum) or v.shape != u.shape:
        other = type(v).__name__ if not isinstance(v, OuterSum) else f"OuterSum {v.shape}"
        raise OperationError(
            f"book-keeping: a parameter of shape {u.shape} is used both inside an operator "
            f"that holds its per-example gradients implicitly and by a {other} use; no rule "
            "forms their cross term. Use clipped_grad(method='vmap')"
        )
    return u.op.inner_outer(v.a, v.b).float()


def sq_norm(piece: Piece) -> torch.Tensor:
    """Per-example squared Frobenius norm ``[B]`` (fp32 or fp64), by the cheaper route for an
    OuterSum."""
    return sq_norm_abs(piece)[0]


class GramCache:
    """The last input Gram matrix ``[B, T, T]`` (``b_t·b_s``), reused by the next piece whose
    ``b`` is a view of the very same memory (the q/k/v projections, or gate/up, read one
    input): one entry, so it never holds more than one Gram matrix. The input is kept alive
    while cached (its memory cannot be reused by another tensor) and its version counter is
    part of the key (an in-place change is a miss).

    >>> import torch
    >>> x, cache = torch.ones(1, 2, 3), GramCache()
    >>> cache.gram(x.reshape(1, 2, 3)) is cache.gram(x.reshape(1, 2, 3))
    True
    """

    __slots__ = ("_input", "_key", "_value")

    def __init__(self) -> None:
        self._key: tuple[object, ...] | None = None
        self._input: torch.Tensor | None = None
        self._value: torch.Tensor | None = None

    def gram(self, b: torch.Tensor) -> torch.Tensor:
        """``bmm(b, bᵀ)`` in fp32 (or fp64), from the cache when ``b`` is the last input."""
        import torch

        key = (b.data_ptr(), tuple(b.shape), b.stride(), b.dtype, b.device, b._version)
        if self._key != key or self._value is None:
            self._value = torch.bmm(_f32(b), _f32(b).transpose(1, 2))
            self._key, self._input = key, b
        return self._value


def sq_norm_abs(piece: Piece, cache: GramCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sq_norm(piece), abs_norm(piece))`` in one pass where possible: on the Gram route the
    token norms are the Gram matrices' diagonals (``(a_t·a_t)(b_t·b_t)`` is on the diagonal of
    their product), so the bound costs no extra pass over the recorded tensors.

    >>> import torch
    >>> piece = OuterSum(torch.tensor([[[1.0], [-1.0]]]), torch.ones(1, 2, 2))
    >>> sq, bound = sq_norm_abs(piece)
    >>> sq.tolist(), [round(v, 4) for v in bound.tolist()]
    ([0.0], [2.8284])
    """
    import torch

    if isinstance(piece, Implicit):
        return piece.op.sq_norms()[0].float(), piece.op.abs_norms().double()
    if isinstance(piece, Dense):
        g = piece.g.reshape(piece.g.shape[0], -1)
        wide = torch.float64 if g.dtype == torch.float64 else torch.float32
        sq = torch.linalg.vector_norm(g, dim=1, dtype=wide).double().square()
        return sq, sq.sqrt()
    rows, cols = piece.shape
    steps = int(piece.b.shape[1])
    if piece.indexed or ghost_is_cheaper(steps, rows, cols):
        if cache is None:
            gram = torch.bmm(_f32(piece.b), _f32(piece.b).transpose(1, 2))
            gram.mul_(_gram_a(piece, piece))  # in place: two T × T matrices at most
        else:  # the input's Gram matrix is shared with the next use of the same input
            gram = _gram_a(piece, piece).mul_(cache.gram(piece.b))
        bound = gram.diagonal(dim1=1, dim2=2).double().sqrt().sum(dim=1)
        return gram.sum(dim=(1, 2), dtype=torch.float64), bound
    g = _materialise(piece)
    sq = torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1).square()
    return sq, abs_norm(piece)


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


def _token_norms(x: torch.Tensor) -> torch.Tensor:
    """``‖x_{i,t}‖`` ``[B, T]`` in fp64, accumulated in fp32 (no host sync: a norm that
    overflows fp32 is ``inf``, and its example then counts as non-finite, as in the vmap
    engine, whose fp32 norm overflows first)."""
    import torch

    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    norms: torch.Tensor = torch.linalg.vector_norm(x, dim=-1, dtype=dtype)
    return norms.double()


def abs_norm(piece: Piece) -> torch.Tensor:
    """Per-example ``Σ_t ‖a_t‖ ‖b_t‖`` ``[B]`` (fp64): an upper bound of ``‖G_i‖`` (triangle
    inequality) that cancellation cannot shrink, and the scale of every rounding error in the
    Gram-based results of a piece (``‖g_i‖`` for a :class:`Dense`).

    >>> import torch
    >>> a = torch.tensor([[[1.0], [-1.0]]])  # two tokens whose gradients cancel exactly
    >>> piece = OuterSum(a, torch.ones(1, 2, 2))
    >>> sq_norm(piece).tolist(), [round(v, 4) for v in abs_norm(piece).tolist()]
    ([0.0], [2.8284])
    """
    if isinstance(piece, Implicit):
        return piece.op.abs_norms().double()
    if isinstance(piece, Dense):
        return _token_norms(piece.g.reshape(piece.g.shape[0], 1, -1))[:, 0]
    b = _token_norms(piece.b)
    if piece.indexed:
        return b.sum(dim=1)
    return (_token_norms(piece.a) * b).sum(dim=1)


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
