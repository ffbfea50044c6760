"""Triton kernels of the layer ops (``@triton.jit``): RMSNorm, gated activations, rotary
embedding. Launched only by ``_layer_ops``, only on plain contiguous tensors; fp32 math inside.
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton types kernel arguments itself: Python annotations would change their specialisation)
# ruff: noqa: PLR0917  (Triton launches take positional arguments only)

from __future__ import annotations

import triton
import triton.language as tl

from opake.kernels.triton._kernels import tanh as _tanh

__all__ = [
    "gated_bwd_kernel",
    "gated_fwd_kernel",
    "rms_norm_bwd_kernel",
    "rms_norm_fwd_kernel",
    "rope_kernel",
]


@triton.jit
def rms_norm_fwd_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    D,
    eps,
    offset,
    HAS_W: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * rstd
    if HAS_W:
        y = y * (tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) + offset)
    tl.store(y_ptr + row * D + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def rms_norm_bwd_kernel(
    x_ptr,
    w_ptr,
    rstd_ptr,
    g_ptr,
    gx_ptr,
    part_ptr,
    R,
    D,
    offset,
    HAS_W: tl.constexpr,
    NEED_X: tl.constexpr,
    NEED_W: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``ROWS`` rows per program; writes one fp32 partial ``sum g * x_hat`` per program."""
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    wf = tl.zeros((BLOCK_D,), tl.float32) + 1.0
    if HAS_W:
        wf = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) + offset
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        rmask = mask & (row < R)
        x = tl.load(x_ptr + row * D + offs, mask=rmask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * D + offs, mask=rmask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=row < R, other=0.0)
        xhat = x * rstd
        if NEED_W:
            acc += g * xhat
        if NEED_X:
            u = g * wf
            dot = tl.sum(u * xhat, axis=0) / D
            gx = rstd * (u - xhat * dot)
            tl.store(gx_ptr + row * D + offs, gx.to(gx_ptr.dtype.element_ty), mask=rmask)
    if NEED_W:
        tl.store(part_ptr + pid * D + offs, acc, mask=mask)


@triton.jit
def _act(a, KIND: tl.constexpr):
    """``(act(a), act'(a))`` in fp32; KIND 0 = silu, 1 = exact gelu, 2 = tanh gelu."""
    if KIND == 0:
        s = 1.0 / (1.0 + tl.exp(-a))
        return a * s, s * (1.0 + a * (1.0 - s))
    if KIND == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(a * 0.7071067811865476))
        pdf = tl.exp(-0.5 * a * a) * 0.3989422804014327
        return a * cdf, cdf + a * pdf
    k = 0.7978845608028654
    t = _tanh(k * (a + 0.044715 * a * a * a))
    half = 0.5 * (1.0 + t)
    return a * half, half + 0.5 * a * (1.0 - t * t) * k * (1.0 + 0.134145 * a * a)


@triton.jit
def gated_fwd_kernel(a_ptr, b_ptr, o_ptr, numel, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act, _ = _act(a, KIND)
    tl.store(o_ptr + offs, (act * b).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gated_bwd_kernel(
    a_ptr, b_ptr, g_ptr, ga_ptr, gb_ptr, numel, KIND: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act, dact = _act(a, KIND)
    tl.store(ga_ptr + offs, (g * b * dact).to(ga_ptr.dtype.element_ty), mask=mask)
    tl.store(gb_ptr + offs, (g * act).to(gb_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    map_ptr,
    o_ptr,
    D,
    HALF,
    BACKWARD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Forward ``x·cos + rotate_half(x)·sin``; backward ``g·cos + rotate_halfᵀ(g·sin)``."""
    row = tl.program_id(0).to(tl.int64)
    crow = tl.load(map_ptr + row).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    x1 = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + row * D + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + crow * D + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + crow * D + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + crow * D + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + crow * D + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    tl.store(o_ptr + row * D + offs, o1.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + row * D + HALF + offs, o2.to(o_ptr.dtype.element_ty), mask=mask)
