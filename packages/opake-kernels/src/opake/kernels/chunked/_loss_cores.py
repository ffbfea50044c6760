"""Pure-PyTorch cores of the chunked loss ops: linear cross-entropy and cross-entropy (plain
tensors only; see ``_autograd``).

Linear cross-entropy tiles tokens x vocabulary: the forward keeps a running log-sum-exp per
token across vocabulary tiles (``logaddexp`` of tile log-sum-exps), the backward recomputes each
logits tile from ``hidden`` and ``weight`` and accumulates the gradients tile by tile — unless
the forward could form them in its own pass (one tile spanning the vocabulary, or the hidden
states' gradient alone, :func:`_lce_forward_online`). At most one
``token_tile x vocab_tile`` logits tile (and a few fp32 temporaries of that size) exists at a time
(the tile itself: ``_logit_tiles``). Cross-entropy on materialised logits processes bounded row
chunks and recomputes the chunk's probabilities in the backward.
"""

# ruff: noqa: PLR0917  (autograd.Function.apply and Triton launches take positional arguments only)

from __future__ import annotations

import math
from typing import Any

import torch

from opake.kernels._args import LossSpec
from opake.kernels._math import token_grad, token_loss, transform_logits_
from opake.kernels.chunked._logit_tiles import _dlogits_, _dprobs_, _target_logit, _TileBuffers

__all__ = ["ce_backward", "ce_forward", "lce_backward", "lce_forward"]

Tensor = torch.Tensor
_F32 = torch.float32


def _tiles(opts: Any, n: int, v: int) -> tuple[int, int]:
    if opts is None:
        return max(1, n), v
    tt, vt = opts
    return max(1, min(int(tt), max(1, n))), max(1, min(int(vt), v))


def lce_forward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    spec: LossSpec,
    opts: Any,
    pre: tuple[bool, bool, bool] = (False, False, False),
) -> tuple[Tensor, Tensor, tuple[Tensor | None, Tensor | None, Tensor | None] | None]:
    """Per-token losses (masked), log-sum-exps (fp32 ``(N,)``) and, maybe, the gradients.

    Online log-sum-exp across vocabulary tiles: a running max ``m`` and sum ``s`` per token,
    rescaled when a tile raises the max. When one tile spans the whole vocabulary and *pre*
    asks for gradients (of hidden, weight, bias) of a ``sum``/``mean`` loss, the probabilities
    are at hand right after the log-sum-exp, so the gradients for a unit upstream gradient per
    segment are computed in the same pass (weight/bias ones per segment) and returned: the
    backward then only scales them, and no tile is computed twice.
    """
    n = hidden.shape[0]
    v = weight.shape[0]
    tt, vt = _tiles(opts, n, v)
    if _online(spec, pre, bias, n, vt, v):
        return _lce_forward_online(hidden, weight, bias, labels, spec, tt, vt)
    dev = hidden.device
    lse = torch.empty(n, dtype=_F32, device=dev)
    tok = torch.empty(n, dtype=_F32, device=dev)
    fused = any(pre) and spec.reduction != "none" and vt >= v and n > 0
    if n == 0:
        return tok, lse, None
    gh = gw = gb = None
    # segments one at a time only for per-segment weight/bias gradients (tiles then stop at
    # segment ends); the hidden states' gradient is per token: tiles span segments
    split = fused and (pre[1] or (pre[2] and bias is not None))
    groups = spec.n_seg if split else 1
    per = n // groups
    tt = min(tt, per)
    if fused:
        tgrad = token_grad(torch.ones(spec.n_seg, dtype=_F32, device=dev), labels, spec)
        gh = torch.empty(n, hidden.shape[1], dtype=_F32, device=dev) if pre[0] else None
        gw = torch.empty(groups, v, hidden.shape[1], dtype=_F32, device=dev) if pre[1] else None
        if pre[2] and bias is not None:
            gb = torch.zeros(groups, v, dtype=_F32, device=dev)
    bufs = _TileBuffers(tt, vt, hidden.dtype, dev, extra=fused and spec.softcap is not None)
    for g in range(groups):
        for t0 in range(g * per, (g + 1) * per if fused else n, tt):
            t1 = min((g + 1) * per if fused else n, t0 + tt)
            h, y = hidden[t0:t1], labels[t0:t1]
            m = torch.full((t1 - t0,), -math.inf, dtype=_F32, device=dev)
            s = torch.zeros_like(m)
            zy = torch.zeros_like(m)
            zs = torch.zeros_like(m) if spec.smoothing else None
            for v0 in range(0, v, vt):
                v1 = min(v, v0 + vt)
                w = weight[v0:v1]
                z = bufs.logits(h, w, None if bias is None else bias[v0:v1], spec)
                zy += _target_logit(z, y, v0)
                if zs is not None:
                    zs += z.sum(1)
                t = None
                if fused and spec.softcap is not None:
                    assert bufs.t is not None  # allocated for a fused softcap (extra=)
                    t = torch.div(z, spec.softcap, out=bufs.view(bufs.t, *z.shape))
                if not fused:  # running log-sum-exp across vocabulary tiles
                    m_new = torch.maximum(m, z.amax(1))
                    s.mul_(torch.exp(m - m_new)).add_(z.sub_(m_new.unsqueeze(1)).exp_().sum(1))
                    m = m_new
                else:  # one tile holds the whole vocabulary: no rescaling
                    m = z.amax(1)
                    s = z.sub_(m.unsqueeze(1)).exp_().sum(1)
                    # z is exp(z - m): normalised and times the token gradients in one pass
                    d = _dprobs_(z, y, tgrad[t0:t1], v0, v, spec, t, norm=s)
                    if gb is not None:
                        gb[g] += d.sum(0)
                    # raw: the input-dtype scratch, which exists when the inputs are not fp32
                    dc = d if bufs.raw is None else bufs.view(bufs.raw, *d.shape).copy_(d)
                    if gh is not None:
                        _accumulate(gh[t0:t1], dc, w, first=True)
                    if gw is not None:
                        _accumulate(gw[g, v0:v1], dc.t(), h, first=t0 == g * per)
            run = m + torch.log(s)
            lse[t0:t1] = run
            loss = token_loss(run, zy, zs, v, spec)
            tok[t0:t1] = torch.where(y != spec.ignore_index, loss, torch.zeros_like(loss))
        if not fused:
            break
    return tok, lse, (gh, gw, gb) if fused else None


def _online(
    spec: LossSpec, pre: tuple[bool, bool, bool], bias: Tensor | None, n: int, vt: int, v: int
) -> bool:
    """Whether the forward forms the hidden states' gradient across vocabulary tiles
    (:func:`_lce_forward_online`): only that gradient asked for, a ``sum``/``mean`` loss, the
    vocabulary split over tiles, no label smoothing."""
    only_hidden = pre[0] and not pre[1] and not (pre[2] and bias is not None)
    return only_hidden and spec.reduction != "none" and vt < v and n > 0 and not spec.smoothing


def _lce_forward_online(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    spec: LossSpec,
    tt: int,
    vt: int,
) -> tuple[Tensor, Tensor, tuple[Tensor | None, Tensor | None, Tensor | None]]:
    """Per-token losses, log-sum-exps and the hidden states' gradient (for a unit upstream
    gradient per segment) in one pass over the vocabulary tiles.

    The hidden gradient of token ``t`` is ``tgrad_t·mult·(Σ_v p_tv a_tv W_v − a_ty W_y)``
    (``a`` the softcap's derivative, 1 without one). Its first sum is accumulated like the
    log-sum-exp itself: ``Σ_v exp(z_tv − m_t) a_tv W_v`` with the running max ``m_t``,
    rescaled by ``exp(m_old − m_new)`` when a tile raises it, and divided by the final
    ``Σ_v exp(z_tv − m_t)`` at the end. Each logits tile is computed once (the backward only
    scales the result), where recomputing them in the backward costs a third matrix product
    over the vocabulary.
    """
    n, v = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    lse = torch.empty(n, dtype=_F32, device=dev)
    tok = torch.empty(n, dtype=_F32, device=dev)
    gh = torch.empty(n, hidden.shape[1], dtype=_F32, device=dev)
    tgrad = token_grad(torch.ones(spec.n_seg, dtype=_F32, device=dev), labels, spec)
    bufs = _TileBuffers(tt, vt, hidden.dtype, dev, extra=spec.softcap is not None)
    for t0 in range(0, n, tt):
        t1 = min(n, t0 + tt)
        h, y, acc = hidden[t0:t1], labels[t0:t1], gh[t0:t1]
        m = s = torch.empty(0)
        zy = torch.zeros(t1 - t0, dtype=_F32, device=dev)
        for v0 in range(0, v, vt):
            w = weight[v0 : min(v, v0 + vt)]
            z = bufs.logits(h, w, None if bias is None else bias[v0 : v0 + vt], spec)
            zy += _target_logit(z, y, v0)
            slope = None
            if spec.softcap is not None:
                assert bufs.t is not None  # allocated for a softcap (extra=)
                slope = torch.div(z, spec.softcap, out=bufs.view(bufs.t, *z.shape))
                slope.mul_(slope).neg_().add_(1.0)  # 1 − tanh², the softcap's derivative
            top = z.amax(1)
            if v0:
                top = torch.maximum(m, top)
                rescale = torch.exp(m - top)
                s.mul_(rescale)
                acc.mul_(rescale.unsqueeze(1))
            e = z.sub_(top.unsqueeze(1)).exp_()
            s = e.sum(1) if not v0 else s.add_(e.sum(1))
            m = top
            if slope is not None:
                e.mul_(slope)
            dc = e if bufs.raw is None else bufs.view(bufs.raw, *e.shape).copy_(e)
            _accumulate(acc, dc, w, first=not v0)
        run = m + torch.log(s)
        lse[t0:t1] = run
        loss = token_loss(run, zy, None, v, spec)
        tok[t0:t1] = torch.where(y != spec.ignore_index, loss, torch.zeros_like(loss))
        g = tgrad[t0:t1]
        acc.mul_((g / s).unsqueeze(1))
        target = g if spec.softcap is None else g * (1.0 - (zy / spec.softcap).square())
        rows = weight.index_select(0, y.clamp(0, v - 1)).float()
        acc.sub_(rows.mul_(target.unsqueeze(1)))
        if spec.mult is not None:
            acc.mul_(spec.mult)
    return tok, lse, (gh, None, None)


def lce_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    lse: Tensor,
    tgrad: Tensor,
    spec: LossSpec,
    opts: Any,
    needs: tuple[bool, bool, bool],
    groups: int,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of ``sum_i tgrad_i * loss_i``; weight/bias ones per contiguous token group."""
    n, hsize = hidden.shape
    v = weight.shape[0]
    need_h, need_w, need_b = needs[0], needs[1], needs[2] and bias is not None
    dev = hidden.device
    per = n // groups if groups else 0
    # every element of gh/gw is overwritten by its first tile (beta=0), so no zero-fill pass
    alloc = torch.empty if per else torch.zeros
    gh = alloc(n, hsize, dtype=_F32, device=dev) if need_h else None
    gw = alloc(groups, v, hsize, dtype=_F32, device=dev) if need_w else None
    gb = torch.zeros(groups, v, dtype=_F32, device=dev) if need_b else None
    if per == 0:
        return _cast_grads(gh, gw, gb, hidden, weight, bias)
    tt, vt = _tiles(opts, per, v)
    bufs = _TileBuffers(tt, vt, hidden.dtype, dev, extra=spec.softcap is not None)
    for g in range(groups):
        for t0 in range(g * per, (g + 1) * per, tt):
            t1 = min((g + 1) * per, t0 + tt)
            h, y = hidden[t0:t1], labels[t0:t1]
            for v0 in range(0, v, vt):
                v1 = min(v, v0 + vt)
                w = weight[v0:v1]
                z = bufs.logits(h, w, None if bias is None else bias[v0:v1], spec)
                scratch = None if bufs.t is None else bufs.view(bufs.t, *z.shape)
                d = _dlogits_(z, y, lse[t0:t1], tgrad[t0:t1], v0, v, spec, scratch)
                if gb is not None:
                    gb[g, v0:v1] += d.sum(0)
                dc = d
                if bufs.raw is not None:  # the inputs are not fp32
                    dc = bufs.view(bufs.raw, *d.shape).copy_(d)
                if gh is not None:
                    _accumulate(gh[t0:t1], dc, w, first=v0 == 0)
                if gw is not None:
                    _accumulate(gw[g, v0:v1], dc.t(), h, first=t0 == g * per)
    return _cast_grads(gh, gw, gb, hidden, weight, bias)


def _accumulate(dst: Tensor, a: Tensor, b: Tensor, *, first: bool) -> None:
    """``dst (fp32) = a @ b`` on the first tile, ``+=`` after; the product in ``a``'s dtype."""
    if a.dtype == _F32:
        dst.addmm_(a, b, beta=0.0 if first else 1.0)
    elif first:
        dst.copy_(torch.mm(a, b))
    else:
        dst += torch.mm(a, b)


def _cast_grads(
    gh: Tensor | None,
    gw: Tensor | None,
    gb: Tensor | None,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    return (
        None if gh is None else gh.to(hidden.dtype),
        None if gw is None else gw.to(weight.dtype),
        None if gb is None or bias is None else gb.to(bias.dtype),
    )


def ce_forward(logits: Tensor, labels: Tensor, spec: LossSpec, opts: Any) -> tuple[Tensor, Tensor]:
    """Cross-entropy on materialised logits, one bounded chunk of rows at a time."""
    n, v = logits.shape
    rows = max(1, min(int(opts), n)) if n else 1
    lse = torch.empty(n, dtype=_F32, device=logits.device)
    tok = torch.empty(n, dtype=_F32, device=logits.device)
    for t0 in range(0, n, rows):
        t1 = min(n, t0 + rows)
        z = transform_logits_(logits[t0:t1].to(_F32, copy=True), spec)
        y = labels[t0:t1]
        run = torch.logsumexp(z, 1)
        zs = z.sum(1) if spec.smoothing else None
        loss = token_loss(run, _target_logit(z, y, 0), zs, v, spec)
        lse[t0:t1] = run
        tok[t0:t1] = torch.where(y != spec.ignore_index, loss, torch.zeros_like(loss))
    return tok, lse


def ce_backward(
    logits: Tensor, labels: Tensor, lse: Tensor, tgrad: Tensor, spec: LossSpec, opts: Any
) -> Tensor:
    """Gradient w.r.t. the logits, written chunk by chunk in the logits' dtype."""
    n, v = logits.shape
    rows = max(1, min(int(opts), n)) if n else 1
    out = torch.empty_like(logits)
    for t0 in range(0, n, rows):
        t1 = min(n, t0 + rows)
        z = transform_logits_(logits[t0:t1].to(_F32, copy=True), spec)
        d = _dlogits_(z, labels[t0:t1], lse[t0:t1], tgrad[t0:t1], 0, v, spec)
        out[t0:t1] = d
    return out
