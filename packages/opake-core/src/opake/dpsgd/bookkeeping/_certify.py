"""Certified clipping for the book-keeping engine: norms that rounding cannot shrink.

The Gram ("ghost") norm ``‖Σ_t a_t b_tᵀ‖² = Σ_{t,s} (a_t·a_s)(b_t·b_s)`` is computed in fp32
from Gram entries that each carry a rounding error proportional to ``‖a_t‖‖a_s‖`` (resp.
``‖b_t‖‖b_s‖``), however small the entry. Summed, the error scales with
``S = (Σ_t ‖a_t‖‖b_t‖)²`` — not with the norm ``N`` itself. When the per-token terms are large
and cancel (``S ≫ N``: the same input at every position with output gradients of alternating
sign), the computed norm can be far too small, or zero, and the example is barely clipped.
The clipped sum is a contraction over all tokens, whose rounding scales with ``√S`` too.

So per example and parameter (leaf), with ``s = Σ_pieces Σ_t ‖a_t‖‖b_t‖`` (``sq_norm_abs``:
off the Gram product's diagonal on the Gram route, one pass over the recorded tensors
otherwise) and ``γ = MARGIN · 2⁻²⁴``:

- the clip factor is computed from the upper bound ``√(N̂ + γ s²) + γ s`` instead of ``√N̂``
  (the first term bounds the norm, the second the contraction's rounding): on ordinary data
  ``s² ≈ T·N`` and this shrinks a clipped contribution by ``≈ γ·T`` (2·10⁻⁵ at T = 64);
- where that bound is looser than ``LOOSE`` relative to ``√N̂`` (strong cancellation), or the
  computed norm is not finite while the recorded tensors are, the example takes the **exact
  route** for that leaf: its gradient is materialised, rows block by rows block in fp64
  (products of fp32 numbers are exact there), rounded to fp32, and that very tensor is both
  measured and added (scaled by its factor) — the vmap engine's guarantee. The example is
  left out of the leaf's contraction.

``MARGIN`` covers the measured first-order error of fp32 Gram products (at most ``0.9 · 2⁻²⁴·S``
on a Llama's layers) 9-fold; it is a model of fp32 rounding, not Wilkinson's worst case
``n·2⁻²⁴·S`` (a bound no fp32 engine meets cheaply). Matrix products run at full fp32
precision here (:func:`full_precision` switches TF32 off).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from opake.dpsgd.bookkeeping._rules import Piece, example_rows

if TYPE_CHECKING:
    import torch

__all__ = ["LOOSE", "MARGIN", "bounds", "exact_add", "exact_sq_norm", "full_precision"]

UNIT = 2.0**-24  # fp32 unit roundoff
MARGIN = 8.0
GAMMA = MARGIN * UNIT
LOOSE = 1e-3  # take the exact route where the bound exceeds the computed norm by more
_BLOCK = 1 << 22  # elements of one fp64 row block of the exact route


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """fp32 matrix products at full precision (no TF32/bf16 shortcuts) inside the block."""
    import torch

    before = torch.get_float32_matmul_precision()
    if before == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def bounds(leaf_sq: torch.Tensor, leaf_abs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(clip_sq, exact)`` from computed squared norms and absolute sums ``[B, L]`` (fp64).

    ``clip_sq`` bounds the squared norm of what each example adds to each leaf (clip with it);
    ``exact`` marks where the bound is too loose and the exact route must replace it.
    Non-finite absolute sums (NaN/Inf in the recorded tensors) stay non-finite: the example
    contributes nothing.

    >>> import torch
    >>> clip_sq, exact = bounds(torch.tensor([[4.0, 0.0]]), torch.tensor([[2.0, 3.0]]))
    >>> exact.tolist(), bool(clip_sq[0, 0] > 4.0)
    ([[False, True]], True)
    """
    import torch

    computed = leaf_sq.clamp(min=0.0)
    bound = (computed + GAMMA * leaf_abs.square()).sqrt() + GAMMA * leaf_abs
    clip_sq = torch.where(torch.isfinite(leaf_abs), bound.square(), leaf_abs)
    finite = torch.isfinite(leaf_abs)
    loose = bound > computed.sqrt() * (1.0 + LOOSE)
    exact = finite & (loose | ~torch.isfinite(leaf_sq))
    return clip_sq, exact


def _blocks(shape: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    rows = int(shape[0]) if len(shape) else 1
    cols = 1
    for n in shape[1:]:
        cols *= int(n)
    step = max(1, _BLOCK // max(1, cols))
    for start in range(0, rows, step):
        yield start, min(rows, start + step), cols


def _block(pieces: Sequence[Piece], index: int, start: int, stop: int) -> torch.Tensor:
    total = example_rows(pieces[0], index, start, stop)
    for piece in pieces[1:]:
        total = total + example_rows(piece, index, start, stop)
    return total.float()


def exact_sq_norm(pieces: Sequence[Piece], index: int, shape: Sequence[int]) -> torch.Tensor:
    """``‖Ĝ‖²`` (fp64 0-d) of example ``index``'s leaf gradient ``Ĝ`` (fp32, built in fp64).

    >>> import torch
    >>> from opake.dpsgd.bookkeeping._rules import OuterSum
    >>> a = torch.tensor([[[1e8], [-1e8], [1.0]]])  # two huge tokens cancel exactly
    >>> piece = OuterSum(a, torch.ones(1, 3, 2))
    >>> float(exact_sq_norm([piece], 0, (1, 2)))
    2.0
    """
    total: torch.Tensor | None = None
    for start, stop, _ in _blocks(shape):
        block = _block(pieces, index, start, stop).double().square().sum()
        total = block if total is None else total + block
    assert total is not None
    return total


def exact_add(pieces: Sequence[Piece], index: int, factor: torch.Tensor, out: torch.Tensor) -> None:
    """``out += factor · Ĝ`` in place (fp32), ``Ĝ`` as measured by :func:`exact_sq_norm`."""
    flat = out.view(out.shape[0] if out.dim() else 1, -1)
    for start, stop, _ in _blocks(tuple(out.shape)):
        block = _block(pieces, index, start, stop)
        flat[start:stop].add_(block * factor.to(block.dtype))
