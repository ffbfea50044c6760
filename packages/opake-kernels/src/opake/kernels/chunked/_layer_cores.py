"""Pure-PyTorch cores of the chunked layer ops: RMSNorm, gated activations (SwiGLU/GeGLU) and
rotary embedding (plain tensors only; see ``_autograd``).

Each processes bounded row/element chunks in fp32, recomputes in the backward what autograd
would have saved, and keeps only its inputs (plus one fp32 number per row for RMSNorm).

>>> import torch
>>> x = torch.randn(5, 8)
>>> y, rstd = rms_norm_forward(x, None, 1e-6, 0.0, rows=2)
>>> torch.allclose(y, x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6))
True
"""

# ruff: noqa: PLR0917  (autograd.Function.apply and Triton launches take positional arguments only)

from __future__ import annotations

import torch

__all__ = [
    "activation",
    "activation_backward_",
    "gated_backward",
    "gated_forward",
    "rms_norm_backward",
    "rms_norm_forward",
    "rope_backward",
    "rope_forward",
]

Tensor = torch.Tensor
_F32 = torch.float32


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
