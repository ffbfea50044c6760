"""Triton loss kernels (``@triton.jit``): linear cross-entropy and cross-entropy. Launched only
by ``_loss_ops``, only on plain contiguous tensors (the layer kernels are in ``_layer_kernels``).

Linear cross-entropy works on 2-D ``BLOCK_T x BLOCK_V`` logits tiles, each the sum of
``BLOCK_H``-wide ``tl.dot`` products with an fp32 accumulator. The forward keeps an online
log-sum-exp per token across vocabulary tiles; the two backward kernels recompute each tile
(one writes ``grad_hidden`` per token block, the other ``grad_weight``/``grad_bias`` per
vocabulary block and per token group, so nothing needs atomics and every result is
deterministic). The logit transform (scale, softcap) is applied to each tile *before* the
padding lanes beyond the vocabulary are masked to ``-inf``: a masked lane can never carry
probability (``softcap * tanh(-inf)`` would be ``-softcap``, a finite logit).

``UPCAST`` converts loads to fp32 before ``tl.dot``: the interpreter computes bf16 dots wrongly,
and fp32 ``PREC="ieee"`` keeps fp32 inputs in full precision on the GPU (no TF32).
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton types kernel arguments itself: Python annotations would change their specialisation)
# ruff: noqa: PLR0917  (autograd.Function.apply and Triton launches take positional arguments only)

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "ce_bwd_kernel",
    "ce_fwd_kernel",
    "lce_bwd_h_kernel",
    "lce_bwd_w_kernel",
    "lce_fwd_kernel",
    "tanh",
]


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _transform(z, mult, softcap, HAS_MULT: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    if HAS_MULT:
        z = z * mult
    if HAS_SOFTCAP:
        z = softcap * _tanh(z / softcap)
    return z


@triton.jit
def _lce_tile(
    h_ptr,
    w_ptr,
    b_ptr,
    offs_t,
    tmask,
    offs_v,
    vmask,
    Hd,
    stride_h,
    stride_w,
    mult,
    softcap,
    HAS_BIAS: tl.constexpr,
    HAS_MULT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Transformed fp32 logits of one tile (padding lanes hold finite garbage: mask them)."""
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    for h0 in range(0, Hd, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        hmask = offs_h < Hd
        a = tl.load(
            h_ptr + offs_t[:, None] * stride_h + offs_h[None, :],
            mask=tmask[:, None] & hmask[None, :],
            other=0.0,
        )
        b = tl.load(
            w_ptr + offs_v[:, None] * stride_w + offs_h[None, :],
            mask=vmask[:, None] & hmask[None, :],
            other=0.0,
        )
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_v, mask=vmask, other=0.0).to(tl.float32)[None, :]
    return _transform(acc, mult, softcap, HAS_MULT, HAS_SOFTCAP)


@triton.jit
def _dlogits(
    z,
    offs_v,
    vmask,
    y,
    lse,
    g,
    V,
    mult,
    softcap,
    smoothing,
    HAS_MULT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTH: tl.constexpr,
):
    """Gradient w.r.t. the raw logits of a tile with transformed logits *z* (fp32)."""
    d = tl.exp(z - lse[:, None])
    if HAS_SMOOTH:
        d = d - smoothing / V
    d = d - tl.where(offs_v[None, :] == y[:, None], 1.0 - smoothing, 0.0)
    d = d * g[:, None]
    if HAS_SOFTCAP:
        t = z / softcap
        d = d * (1.0 - t * t)
    if HAS_MULT:
        d = d * mult
    return tl.where(vmask[None, :], d, 0.0)


@triton.jit
def lce_fwd_kernel(
    h_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    N,
    V,
    Hd,
    stride_h,
    stride_w,
    v_per_split,
    mult,
    softcap,
    HAS_BIAS: tl.constexpr,
    HAS_MULT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTH: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Grid (token blocks, vocabulary splits). Each program covers ``v_per_split`` vocabulary
    entries (a multiple of ``BLOCK_V``) of one token block and writes, per token, the partial
    running max, sum of exponentials, target logit and logit sum to ``part[k, split, token]``
    (k = 0..3); the host combines the splits (more programs than token blocks alone)."""
    pid = tl.program_id(0)
    split = tl.program_id(1).to(tl.int64)
    n_splits = tl.num_programs(1).to(tl.int64)
    offs_t = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    tmask = offs_t < N
    y = tl.load(y_ptr + offs_t, mask=tmask, other=-1)
    m = tl.full((BLOCK_T,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_T,), tl.float32)
    zy = tl.zeros((BLOCK_T,), tl.float32)
    zs = tl.zeros((BLOCK_T,), tl.float32)
    v_start = split * v_per_split
    v_end = tl.minimum(v_start + v_per_split, V)
    for v0 in range(v_start, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        vmask = offs_v < v_end
        z = _lce_tile(
            h_ptr, w_ptr, b_ptr, offs_t, tmask, offs_v, vmask, Hd, stride_h, stride_w, mult,
            softcap, HAS_BIAS, HAS_MULT, HAS_SOFTCAP, UPCAST, PREC, BLOCK_T, BLOCK_V, BLOCK_H,
        )  # fmt: skip
        z = tl.where(vmask[None, :], z, float("-inf"))  # after the transform: no leak
        m_new = tl.maximum(m, tl.max(z, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m = m_new
        zy += tl.sum(tl.where(offs_v[None, :] == y[:, None], z, 0.0), axis=1)
        if HAS_SMOOTH:
            zs += tl.sum(tl.where(vmask[None, :], z, 0.0), axis=1)
    row = split * N + offs_t
    plane = n_splits * N
    tl.store(part_ptr + row, m, mask=tmask)
    tl.store(part_ptr + plane + row, s, mask=tmask)
    tl.store(part_ptr + 2 * plane + row, zy, mask=tmask)
    tl.store(part_ptr + 3 * plane + row, zs, mask=tmask)


@triton.jit
def lce_bwd_h_kernel(
    h_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    lse_ptr,
    g_ptr,
    gh_ptr,
    N,
    V,
    Hd,
    stride_h,
    stride_w,
    mult,
    softcap,
    smoothing,
    HAS_BIAS: tl.constexpr,
    HAS_MULT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTH: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``grad_hidden[t] = sum_v d[t, v] * W[v]`` for one block of tokens (fp32 ``gh``)."""
    pid = tl.program_id(0)
    offs_t = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    tmask = offs_t < N
    y = tl.load(y_ptr + offs_t, mask=tmask, other=0)
    lse = tl.load(lse_ptr + offs_t, mask=tmask, other=0.0)
    g = tl.load(g_ptr + offs_t, mask=tmask, other=0.0)
    for v0 in range(0, V, BLOCK_V):
        offs_v = (v0 + tl.arange(0, BLOCK_V)).to(tl.int64)
        vmask = offs_v < V
        z = _lce_tile(
            h_ptr, w_ptr, b_ptr, offs_t, tmask, offs_v, vmask, Hd, stride_h, stride_w, mult,
            softcap, HAS_BIAS, HAS_MULT, HAS_SOFTCAP, UPCAST, PREC, BLOCK_T, BLOCK_V, BLOCK_H,
        )  # fmt: skip
        d = _dlogits(
            z, offs_v, vmask, y, lse, g, V, mult, softcap, smoothing,
            HAS_MULT, HAS_SOFTCAP, HAS_SMOOTH,
        )  # fmt: skip
        if not UPCAST:
            d = d.to(w_ptr.dtype.element_ty)
        for h0 in range(0, Hd, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            hmask = offs_h < Hd
            w = tl.load(
                w_ptr + offs_v[:, None] * stride_w + offs_h[None, :],
                mask=vmask[:, None] & hmask[None, :],
                other=0.0,
            )
            if UPCAST:
                w = w.to(tl.float32)
            part = tl.dot(d, w, input_precision=PREC)
            ptrs = gh_ptr + offs_t[:, None] * Hd + offs_h[None, :]
            m2 = tmask[:, None] & hmask[None, :]
            tl.store(ptrs, tl.load(ptrs, mask=m2, other=0.0) + part, mask=m2)


@triton.jit
def lce_bwd_w_kernel(
    h_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    lse_ptr,
    g_ptr,
    gw_ptr,
    gb_ptr,
    per_group,
    V,
    Hd,
    stride_h,
    stride_w,
    mult,
    softcap,
    smoothing,
    HAS_BIAS: tl.constexpr,
    NEED_W: tl.constexpr,
    NEED_B: tl.constexpr,
    HAS_MULT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTH: tl.constexpr,
    UPCAST: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``grad_weight[grp, v] = sum_{t in grp} d[t, v] * h[t]`` (and ``grad_bias``) per group."""
    pid_v = tl.program_id(0)
    grp = tl.program_id(1).to(tl.int64)
    offs_v = (pid_v * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
    vmask = offs_v < V
    start = grp * per_group
    end = start + per_group
    gb_acc = tl.zeros((BLOCK_V,), tl.float32)
    for t0 in range(start, end, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        tmask = offs_t < end
        y = tl.load(y_ptr + offs_t, mask=tmask, other=0)
        lse = tl.load(lse_ptr + offs_t, mask=tmask, other=0.0)
        g = tl.load(g_ptr + offs_t, mask=tmask, other=0.0)
        z = _lce_tile(
            h_ptr, w_ptr, b_ptr, offs_t, tmask, offs_v, vmask, Hd, stride_h, stride_w, mult,
            softcap, HAS_BIAS, HAS_MULT, HAS_SOFTCAP, UPCAST, PREC, BLOCK_T, BLOCK_V, BLOCK_H,
        )  # fmt: skip
        d = _dlogits(
            z, offs_v, vmask, y, lse, g, V, mult, softcap, smoothing,
            HAS_MULT, HAS_SOFTCAP, HAS_SMOOTH,
        )  # fmt: skip
        d = tl.where(tmask[:, None], d, 0.0)
        if NEED_B:
            gb_acc += tl.sum(d, axis=0)
        if NEED_W:
            dt = tl.trans(d)
            if not UPCAST:
                dt = dt.to(h_ptr.dtype.element_ty)
            for h0 in range(0, Hd, BLOCK_H):
                offs_h = h0 + tl.arange(0, BLOCK_H)
                hmask = offs_h < Hd
                hb = tl.load(
                    h_ptr + offs_t[:, None] * stride_h + offs_h[None, :],
                    mask=tmask[:, None] & hmask[None, :],
                    other=0.0,
                )
                if UPCAST:
                    hb = hb.to(tl.float32)
                part = tl.dot(dt, hb, input_precision=PREC)
                ptrs = gw_ptr + grp * V * Hd + offs_v[:, None] * Hd + offs_h[None, :]
                m2 = vmask[:, None] & hmask[None, :]
                tl.store(ptrs, tl.load(ptrs, mask=m2, other=0.0) + part, mask=m2)
    if NEED_B:
        tl.store(gb_ptr + grp * V + offs_v, gb_acc, mask=vmask)


@triton.jit
def ce_fwd_kernel(
    x_ptr,
    y_ptr,
    loss_ptr,
    lse_ptr,
    N,
    V,
    stride_x,
    ignore_index,
    mult,
    softcap,
    smoothing,
    HAS_MULT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTH: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_t = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    tmask = offs_t < N
    y = tl.load(y_ptr + offs_t, mask=tmask, other=ignore_index)
    m = tl.full((BLOCK_T,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_T,), tl.float32)
    zy = tl.zeros((BLOCK_T,), tl.float32)
    zs = tl.zeros((BLOCK_T,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs_v = (v0 + tl.arange(0, BLOCK_V)).to(tl.int64)
        vmask = offs_v < V
        z = tl.load(
            x_ptr + offs_t[:, None] * stride_x + offs_v[None, :],
            mask=tmask[:, None] & vmask[None, :],
            other=0.0,
        ).to(tl.float32)
        z = _transform(z, mult, softcap, HAS_MULT, HAS_SOFTCAP)
        z = tl.where(vmask[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m = m_new
        zy += tl.sum(tl.where(offs_v[None, :] == y[:, None], z, 0.0), axis=1)
        if HAS_SMOOTH:
            zs += tl.sum(tl.where(vmask[None, :], z, 0.0), axis=1)
    lse = m + tl.log(s)
    loss = lse - (1.0 - smoothing) * zy
    if HAS_SMOOTH:
        loss = loss - (smoothing / V) * zs
    loss = tl.where(y != ignore_index, loss, 0.0)
    tl.store(loss_ptr + offs_t, loss, mask=tmask)
    tl.store(lse_ptr + offs_t, lse, mask=tmask)


@triton.jit
def ce_bwd_kernel(
    x_ptr,
    y_ptr,
    lse_ptr,
    g_ptr,
    gx_ptr,
    N,
    V,
    stride_x,
    mult,
    softcap,
    smoothing,
    HAS_MULT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTH: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_t = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    tmask = offs_t < N
    y = tl.load(y_ptr + offs_t, mask=tmask, other=0)
    lse = tl.load(lse_ptr + offs_t, mask=tmask, other=0.0)
    g = tl.load(g_ptr + offs_t, mask=tmask, other=0.0)
    for v0 in range(0, V, BLOCK_V):
        offs_v = (v0 + tl.arange(0, BLOCK_V)).to(tl.int64)
        vmask = offs_v < V
        m2 = tmask[:, None] & vmask[None, :]
        z = tl.load(x_ptr + offs_t[:, None] * stride_x + offs_v[None, :], mask=m2, other=0.0)
        z = _transform(z.to(tl.float32), mult, softcap, HAS_MULT, HAS_SOFTCAP)
        d = _dlogits(
            z, offs_v, vmask, y, lse, g, V, mult, softcap, smoothing,
            HAS_MULT, HAS_SOFTCAP, HAS_SMOOTH,
        )  # fmt: skip
        tl.store(
            gx_ptr + offs_t[:, None] * V + offs_v[None, :],
            d.to(gx_ptr.dtype.element_ty),
            mask=m2,
        )


#: shared with the layer kernels (GELU tanh)
tanh = _tanh
