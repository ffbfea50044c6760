"""Pure-PyTorch cores of the chunked backend (plain tensors only; see ``_autograd``).

Linear cross-entropy tiles tokens x vocabulary: the forward keeps a running log-sum-exp per
token across vocabulary tiles (``logaddexp`` of tile log-sum-exps), the backward recomputes each
logits tile from ``hidden`` and ``weight`` and accumulates the gradients tile by tile. At most one
``token_tile x vocab_tile`` logits tile (and a few fp32 temporaries of that size) exists at a time.
The other ops process bounded row/element chunks, recompute what autograd would have saved,
and keep only their inputs (plus one fp32 number per row for RMSNorm).
"""

# ruff: noqa: PLR0917  (autograd.Function.apply and Triton launches take positional arguments only)

from __future__ import annotations

import math
from typing import Any

import torch

from opake.kernels._args import LossSpec
from opake.kernels._math import token_grad, token_loss, transform_logits_

__all__ = [
    "activation",
    "activation_backward_",
    "ce_backward",
    "ce_forward",
    "gated_backward",
    "gated_forward",
    "lce_backward",
    "lce_forward",
    "rms_norm_backward",
    "rms_norm_forward",
    "rope_backward",
    "rope_forward",
]

Tensor = torch.Tensor
_F32 = torch.float32


def _tiles(opts: Any, n: int, v: int) -> tuple[int, int]:
    if opts is None:
        return max(1, n), v
    tt, vt = opts
    return max(1, min(int(tt), max(1, n))), max(1, min(int(vt), v))


class _TileBuffers:
    """Scratch reused by every tile of one call: allocation churn (and page faults on fresh
    large allocations) would otherwise cost as much as the arithmetic on the CPU."""

    def __init__(self, tt: int, vt: int, dtype: torch.dtype, device: torch.device, extra: bool):
        self.z = torch.empty(tt * vt, dtype=_F32, device=device)
        self.raw = None if dtype == _F32 else torch.empty(tt * vt, dtype=dtype, device=device)
        self.t = torch.empty(tt * vt, dtype=_F32, device=device) if extra else None

    @staticmethod
    def view(buf: Tensor, rows: int, cols: int) -> Tensor:
        return buf[: rows * cols].view(rows, cols)

    def logits(self, h: Tensor, w: Tensor, b: Tensor | None, spec: LossSpec) -> Tensor:
        """Transformed fp32 logits ``h @ w.T + b`` of one tile, in the reused buffer."""
        rows, cols = h.shape[0], w.shape[0]
        z = self.view(self.z, rows, cols)
        out = z if self.raw is None else self.view(self.raw, rows, cols)
        if b is None:
            torch.mm(h, w.t(), out=out)
        else:
            torch.addmm(b, h, w.t(), out=out)
        if self.raw is not None:
            z.copy_(out)
        return transform_logits_(z, spec)


def _target_logit(z: Tensor, y: Tensor, v0: int) -> Tensor:
    """``z[i, y_i - v0]`` where the target lies in this tile, else 0."""
    width = z.shape[1]
    idx = y - v0
    inside = (idx >= 0) & (idx < width)
    picked = z.gather(1, idx.clamp(0, width - 1).unsqueeze(1)).squeeze(1)
    return torch.where(inside, picked, torch.zeros_like(picked))


def _subtract_target(d: Tensor, y: Tensor, v0: int, amount: Tensor) -> None:
    """``d[i, y_i - v0] -= amount_i`` where the target lies in this tile (in place)."""
    width = d.shape[1]
    idx = y - v0
    inside = (idx >= 0) & (idx < width)
    d.scatter_add_(1, idx.clamp(0, width - 1).unsqueeze(1), (-amount * inside).unsqueeze(1))


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
    fp32 = hidden.dtype == _F32
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
                    t = torch.div(z, spec.softcap, out=bufs.view(bufs.t, *z.shape))  # type: ignore[arg-type]
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
                    dc = d if fp32 else bufs.view(bufs.raw, *d.shape).copy_(d)  # type: ignore[arg-type]
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


def _dprobs_(
    p: Tensor,
    y: Tensor,
    tgrad: Tensor,
    v0: int,
    vocab: int,
    spec: LossSpec,
    t: Tensor | None,
    norm: Tensor | None = None,
) -> Tensor:
    """Turn a tile of probabilities *p* (fp32) into the gradient w.r.t. the raw logits, in
    place: ``tgrad·(p - ε/V - (1-ε)·onehot)``, chained through the softcap (``t`` holds
    ``tanh`` of the tile) and the scale. With *norm*, *p* holds unnormalised probabilities:
    row ``i`` is divided by ``norm[i]`` in the same pass."""
    d = p.mul_((tgrad if norm is None else tgrad / norm).unsqueeze(1))
    eps = spec.smoothing
    if eps:
        d.sub_((eps / vocab) * tgrad.unsqueeze(1))
    _subtract_target(d, y, v0, (1.0 - eps) * tgrad)
    if t is not None:
        d.mul_(t.mul_(t).neg_().add_(1.0))
    if spec.mult is not None:
        d.mul_(spec.mult)
    return d


def _dlogits_(
    z: Tensor,
    y: Tensor,
    lse: Tensor,
    tgrad: Tensor,
    v0: int,
    vocab: int,
    spec: LossSpec,
    scratch: Tensor | None = None,
) -> Tensor:
    """Turn transformed logits *z* (fp32) into the gradient w.r.t. the raw logits, in place.

    With a softcap, ``tanh`` of the tile is kept in *scratch* (same shape) for the chain rule.
    """
    t = None
    if spec.softcap is not None:
        t = torch.div(z, spec.softcap, out=scratch) if scratch is not None else z / spec.softcap
    return _dprobs_(z.sub_(lse.unsqueeze(1)).exp_(), y, tgrad, v0, vocab, spec, t)


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
    fp32 = hidden.dtype == _F32
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
                if not fp32:
                    dc = bufs.view(bufs.raw, *d.shape).copy_(d)  # type: ignore[arg-type]
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


def rms_norm_forward(
    x: Tensor, weight: Tensor | None, eps: float, offset: float, rows: int
) -> tuple[Tensor, Tensor]:
    """``y = x·rstd·(offset + weight)`` and the fp32 ``rstd`` per row."""
    n = x.shape[0]
    y = torch.empty_like(x)
    rstd = torch.empty(n, dtype=_F32, device=x.device)
    wf = None if weight is None else weight.float() + offset
    fp32 = x.dtype == _F32 and x.is_contiguous()
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        xf = x[r0:r1] if fp32 else x[r0:r1].to(_F32, copy=True)
        r = torch.rsqrt(xf.pow(2).mean(1) + eps)
        rstd[r0:r1] = r
        # fp32: computed straight into the output rows (no chunk-sized copy)
        out = torch.mul(xf, r.unsqueeze(1), out=y[r0:r1]) if fp32 else xf.mul_(r.unsqueeze(1))
        if wf is not None:
            out.mul_(wf)
        if not fp32:
            y[r0:r1] = out
    return y, rstd


def rms_norm_backward(
    x: Tensor,
    weight: Tensor | None,
    rstd: Tensor,
    gy: Tensor,
    offset: float,
    needs: tuple[bool, bool],
    groups: int,
    rows: int,
) -> tuple[Tensor | None, Tensor | None]:
    """``grad_x = rstd·(u - x̂·mean(u·x̂))`` with ``u = g·(offset+w)``; ``grad_w`` per group."""
    n, dsize = x.shape
    need_x, need_w = needs[0], needs[1] and weight is not None
    gx = torch.empty_like(x) if need_x else None
    gw = torch.zeros(groups, dsize, dtype=_F32, device=x.device) if need_w else None
    wf = None if weight is None else weight.float() + offset
    per = n // groups if groups else 0
    for g in range(groups):
        for r0 in range(g * per, (g + 1) * per, rows):
            r1 = min((g + 1) * per, r0 + rows)
            r = rstd[r0:r1].unsqueeze(1)
            xf = x[r0:r1].float()
            gf = gy[r0:r1].float()
            if gw is not None:
                gw[g] += (gf * (xf * r)).sum(0)
            if gx is not None:
                u = gf
                if wf is not None:  # fp32 contiguous: u = g·w lives in the output rows
                    direct = gx.dtype == _F32 and gx.is_contiguous()
                    u = torch.mul(gf, wf, out=gx[r0:r1]) if direct else gf * wf
                _rms_grad_x(xf, u, r, gx, r0, r1)
    return gx, None if gw is None or weight is None else gw.to(weight.dtype)


def _rms_grad_x(xf: Tensor, u: Tensor, r: Tensor, gx: Tensor, r0: int, r1: int) -> None:
    """``gx[r0:r1] = r·u - x·(r³·(u·x)/d)`` (= ``r·(u - x̂·mean(u·x̂))``): two passes over the
    chunk after the row dot products, written straight into fp32 contiguous outputs."""
    coef = torch.linalg.vecdot(u, xf, dim=1).unsqueeze(1).mul_(r.pow(3)).div_(xf.shape[1])
    if gx.dtype == _F32 and gx.is_contiguous():
        out = gx[r0:r1]
        (out.mul_(r) if out.data_ptr() == u.data_ptr() else torch.mul(u, r, out=out)).addcmul_(
            xf, coef, value=-1.0
        )
    else:
        gx[r0:r1] = torch.mul(u, r).addcmul_(xf, coef, value=-1.0)


def activation(a: Tensor, kind: str, out: Tensor | None = None) -> Tensor:
    """fp32 ``act(a)`` for ``kind`` in ``silu``, ``gelu``, ``gelu_tanh`` (PyTorch's own ops),
    written into *out* when given (no temporary)."""
    if out is None:
        out = torch.empty_like(a)
    if kind == "silu":
        torch.ops.aten.silu.out(a, out=out)
    else:
        approx = "none" if kind == "gelu" else "tanh"
        torch.ops.aten.gelu.out(a, approximate=approx, out=out)
    return out


def activation_backward_(grad: Tensor, a: Tensor, kind: str) -> Tensor:
    """``grad · act'(a)`` written into *grad* (fp32), by PyTorch's own backward kernels (the ones
    eager autograd runs): one pass."""
    if kind == "silu":
        torch.ops.aten.silu_backward.grad_input(grad, a, grad_input=grad)
    else:
        approx = "none" if kind == "gelu" else "tanh"
        torch.ops.aten.gelu_backward.grad_input(grad, a, approximate=approx, grad_input=grad)
    return grad


def gated_forward(gate: Tensor, up: Tensor, kind: str, chunk: int) -> Tensor:
    """``act(gate) * up`` in fp32 chunks, written in the inputs' dtype."""
    out = torch.empty_like(gate)
    flat_g, flat_u, flat_o = gate.reshape(-1), up.reshape(-1), out.view(-1)
    fp32 = out.dtype == _F32
    for i in range(0, flat_g.numel(), chunk):
        a = flat_g[i : i + chunk].float()
        if fp32:  # straight into the output (no temporary)
            activation(a, kind, out=flat_o[i : i + chunk]).mul_(flat_u[i : i + chunk])
        else:
            flat_o[i : i + chunk] = activation(a, kind).mul_(flat_u[i : i + chunk].float())
    return out


def gated_backward(
    gate: Tensor, up: Tensor, g: Tensor, kind: str, chunk: int
) -> tuple[Tensor, Tensor]:
    """``(grad_gate, grad_up)`` recomputing the activation chunk by chunk."""
    ga = torch.empty_like(gate)
    gu = torch.empty_like(up)
    fg, fu, fo = gate.reshape(-1), up.reshape(-1), g.reshape(-1)
    oa, ou = ga.view(-1), gu.view(-1)
    fp32 = ga.dtype == _F32 and gu.dtype == _F32
    for i in range(0, fg.numel(), chunk):
        a = fg[i : i + chunk].float()
        go = fo[i : i + chunk].float()
        if fp32:  # straight into the outputs: act(a)·g, then act'(a)·(g·up) in place
            activation(a, kind, out=ou[i : i + chunk]).mul_(go)
            activation_backward_(torch.mul(go, fu[i : i + chunk], out=oa[i : i + chunk]), a, kind)
        else:
            ou[i : i + chunk] = activation(a, kind).mul_(go)
            oa[i : i + chunk] = activation_backward_(go * fu[i : i + chunk].float(), a, kind)
    return ga, gu


def _rotate(x: Tensor, sign: float) -> Tensor:
    """``sign=-1``: rotate_half ``(-x2, x1)``; ``sign=+1``: its transpose ``(x2, -x1)``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((sign * x2, -sign * x1), dim=-1)


def _rope_chunks(x: Tensor, cos: Tensor, chunk_rows: int) -> list[tuple[slice, bool]]:
    if x.dim() < 2 or x.shape[0] <= 1:
        return [(slice(None), True)]
    table_aligned = cos.dim() == x.dim() and cos.shape[0] == x.shape[0]
    per = max(1, chunk_rows // max(1, x[0].numel() // x.shape[-1]))
    return [(slice(i, i + per), table_aligned) for i in range(0, x.shape[0], per)]


def _rope_apply(x: Tensor, cos: Tensor, sin: Tensor, sign: float, chunk_rows: int) -> Tensor:
    out = torch.empty_like(x)
    for sl, aligned in _rope_chunks(x, cos, chunk_rows):
        c = cos[sl] if aligned else cos
        s = sin[sl] if aligned else sin
        xf = x[sl].float()
        if sign < 0:  # forward: x·cos + rotate_half(x)·sin
            res = xf * c.float() + _rotate(xf, -1.0) * s.float()
        else:  # backward: g·cos + rotate_halfᵀ(g·sin)
            res = xf * c.float() + _rotate(xf * s.float(), 1.0)
        out[sl] = res
    return out


def rope_forward(x: Tensor, cos: Tensor, sin: Tensor, chunk_rows: int) -> Tensor:
    """Rotary embedding of *x* (fp32 math in chunks along the leading dimension)."""
    return _rope_apply(x, cos, sin, -1.0, chunk_rows)


def rope_backward(g: Tensor, cos: Tensor, sin: Tensor, chunk_rows: int) -> Tensor:
    """``grad_x = g·cos + rotate_halfᵀ(g·sin)``."""
    return _rope_apply(g, cos, sin, 1.0, chunk_rows)
