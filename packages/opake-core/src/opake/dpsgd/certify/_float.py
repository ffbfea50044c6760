"""The floating-point model every certified bound rests on, and certified norms of tensors.

Assumptions (the privacy guide's "Proof of the clipping bound" states and uses them):

- IEEE-754 binary32 and binary64, round to nearest; every basic operation (``+``, ``-``,
  ``×``, fused multiply-add, square root, conversion) on finite operands returns
  ``(x op y)(1 + δ) + η`` with ``|δ| ≤ u`` (``u = 2⁻²⁴`` in fp32, ``2⁻⁵³`` in fp64) and
  ``|η| ≤ ETA = 2⁻¹²⁶``: gradual underflow (``|η| ≤ 2⁻¹⁵⁰``) and flush-to-zero (a result below
  ``2⁻¹²⁶`` replaced by 0) are both covered; with denormals-are-zero a subnormal operand may be
  read as 0 (a change of at most ``ETA``). An fp64 result is never subnormal here (every fp64
  quantity below is built from fp32 numbers, whose products are at least ``2⁻²⁹⁸``).
- A sum or dot product of ``n`` terms is evaluated in *any* order or blocking (each term passes
  through at most ``n`` roundings): ``|ŝ − s| ≤ γ(n)·Σ|terms|`` with
  ``γ(n) = n·u / (1 − n·u)`` (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1),
  plus ``2n·ETA`` where fp32 flushes. Products of two fp32 (or bf16/fp16) numbers are exact in
  fp64.
- Matrix products are sums of products (no Strassen-like algorithms); TF32 and reduced-precision
  fp32 products are off while the engine computes (:func:`full_precision`).

Every quantity returned as an *upper bound* here is proven to be one under these assumptions;
the fp64 evaluation of a bound's own formula is covered by :data:`SAFE`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "BLOCK",
    "ETA",
    "SAFE",
    "U32",
    "U64",
    "dense_sq_norms",
    "full_precision",
    "gamma32",
    "gamma64",
    "token_norms",
]

U32 = 2.0**-24  #: fp32 unit roundoff
U64 = 2.0**-53  #: fp64 unit roundoff
ETA = 2.0**-126  #: absolute error of one fp32 operation near underflow (flushed or gradual)
#: relative slack covering the rounding of the fp64 arithmetic that evaluates a bound's formula
#: (at most a few hundred operations per chain, each ≤ 2⁻⁵³; sums over many terms carry their
#: own γ64)
SAFE = 2.0**-40
#: fp32 reductions are cut into blocks of this many terms, each block's result summed in fp64:
#: the fp32 error of a reduction of any length is then γ32(BLOCK), not γ32(length)
BLOCK = 256


def _gamma(n: float, unit: float) -> float:
    nu = float(n) * unit
    if not nu < 0.5:
        raise ValueError(f"γ({n}) with u={unit}: n·u ≥ 1/2, no a-priori bound")
    return nu / (1.0 - nu)


def gamma32(n: float) -> float:
    """``γ(n) = n·u/(1 − n·u)`` for fp32 (``u = 2⁻²⁴``).

    >>> round(gamma32(256) / 2**-24, 6)
    256.003906
    """
    return _gamma(n, U32)


def gamma64(n: float) -> float:
    """``γ(n)`` for fp64 (``u = 2⁻⁵³``).

    >>> gamma64(1) > 2.0**-53
    True
    """
    return _gamma(n, U64)


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """fp32 arithmetic as the proof assumes inside the block: matrix products at full precision
    (no TF32/bf16 shortcuts) and any enclosing ``torch.autocast`` switched off (an autocast
    region around ``grad_fn`` would otherwise run the engines' norms and sums in bf16)."""
    import torch

    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autocast("cpu", enabled=False))
        if torch.cuda.is_available():
            stack.enter_context(torch.autocast("cuda", enabled=False))
        before = torch.get_float32_matmul_precision()
        if before != "highest":
            torch.set_float32_matmul_precision("highest")
            stack.callback(torch.set_float32_matmul_precision, before)
        yield


def _fp32_block_sq(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``Σ`` over the last dimension of ``x²`` as fp64 ``[...]``: fp32 norms of blocks of at
    most :data:`BLOCK` entries, squared and summed in fp64; also the number of blocks."""
    import torch

    n = int(x.shape[-1])
    lead = tuple(x.shape[:-1])
    full = (n // BLOCK) * BLOCK
    parts = []
    if full:
        head = x[..., :full].reshape(*lead, full // BLOCK, BLOCK)
        norms = torch.linalg.vector_norm(head, dim=-1, dtype=torch.float32).double()
        parts.append(norms.square().sum(dim=-1))
    if n > full:
        tail = torch.linalg.vector_norm(x[..., full:], dim=-1, dtype=torch.float32).double()
        parts.append(tail.square())
    if not parts:
        return torch.zeros(lead, dtype=torch.float64, device=x.device), 0
    total = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    return total, -(-n // BLOCK)


def _fp64_sq(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ x², upper bound of the true Σ x²)`` over the last dimension of an fp64 tensor,
    with a power-of-two scaling per row (no overflow, negligible underflow)."""
    import torch

    n = int(x.shape[-1])
    peak = x.abs().amax(dim=-1) if n else torch.zeros(x.shape[:-1], dtype=x.dtype)
    finite = torch.isfinite(peak)
    _, exp = torch.frexp(torch.where(finite & (peak > 0), peak, 1.0))
    scale = torch.ldexp(torch.ones_like(peak), -exp)  # exact powers of two
    scaled = x * scale[..., None]  # entries ≤ 1 in magnitude; exact unless they underflow
    sq = scaled.square().sum(dim=-1)
    # Σ (x·2⁻ᵉ)² ≥ 1/4 when x ≠ 0; each square or scaled entry lost to underflow is below
    # 2⁻¹⁰²², so n·2⁻¹⁰²⁰ covers them relative to that, with γ64(n + 2) for the rounding
    up = (sq * (1.0 + 2.0 * gamma64(n + 2)) + n * 2.0**-1020) * (1.0 + SAFE)
    factor = torch.ldexp(torch.ones_like(peak), 2 * exp)
    out_hat = torch.where(finite, sq * factor, torch.full_like(sq, math.inf))
    out_up = torch.where(finite, up * factor, torch.full_like(sq, math.inf))
    return out_hat, out_up


def dense_sq_norms(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(computed ‖x_i‖², certified upper bound of ‖x_i‖²)`` per row of ``x [m, n]`` (fp64).

    For fp32, bf16 and fp16 rows: fp32 2-norms of blocks of :data:`BLOCK` entries, squared and
    summed in fp64. Each block's sum of squares is computed with ``|ŝ − s| ≤ γ32(BLOCK + 4)·s
    + 3·BLOCK·ETA`` (squares, sums and the square root, with any scaling a norm routine applies),
    so ``s ≤ (v̂²·(1 + u)²/(1 − γ) + 3·BLOCK·ETA/(1 − γ))`` for the block's computed norm
    ``v̂``; the fp64 sum over blocks adds ``γ64(blocks)``. A block whose fp32 norm overflows
    (entries beyond ``√FLT_MAX``) makes its row recomputed in fp64. fp64 rows are summed in
    fp64 with a power-of-two scaling (:func:`_fp64_sq`). Non-finite rows give ``inf``/``nan``.

    >>> import torch
    >>> hat, up = dense_sq_norms(torch.tensor([[3.0, 4.0], [0.0, 0.0]]))
    >>> hat.tolist(), bool((up >= hat).all()), float(up[0]) - 25.0 < 1e-4
    ([25.0, 0.0], True, True)
    """
    import torch

    flat = x.reshape(x.shape[0], -1) if x.dim() else x.reshape(1, 1)
    m, n = int(flat.shape[0]), int(flat.shape[1])
    if flat.dtype == torch.float64:
        return _fp64_sq(flat)
    hat, blocks = _fp32_block_sq(flat)
    g = gamma32(min(n, BLOCK) + 4)
    per_block = 3.0 * min(n, BLOCK) * ETA / (1.0 - g)
    up = hat * ((1.0 + U32) ** 2 / (1.0 - g)) + blocks * per_block
    up = up * (1.0 + 2.0 * gamma64(max(blocks, 1) + 2)) * (1.0 + SAFE)
    if m and not bool(torch.isfinite(hat).all()):
        # finite entries whose fp32 squares overflow: those rows again, in fp64
        rows = (~torch.isfinite(hat) & torch.isfinite(flat).all(dim=1)).nonzero().flatten()
        if rows.numel():
            hat64, up64 = _fp64_sq(flat[rows].double())
            hat, up = hat.index_put((rows,), hat64), up.index_put((rows,), up64)
    return hat, up


def token_norms(x: torch.Tensor) -> torch.Tensor:
    """Certified upper bounds of ``‖x_{i,t}‖`` ``[B, T]`` (fp64) for ``x [B, T, d]``.

    >>> import torch
    >>> float(token_norms(torch.tensor([[[3.0, 4.0]]]))[0, 0]) - 5.0 < 1e-5
    True
    """
    batch, steps = int(x.shape[0]), int(x.shape[1])
    _, up = dense_sq_norms(x.reshape(batch * steps, -1))
    return up.sqrt().mul_(1.0 + SAFE).reshape(batch, steps)
