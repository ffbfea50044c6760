"""One logits tile of a chunked (linear) cross-entropy: its scratch buffers, its target logit
and its gradient w.r.t. the raw logits.

Every tiled pass builds on these: the loss cores (``_loss_cores``), the implicit per-example
gradients (``_example_grads``) and the kept logit gradients (``_kept``). A tile is
``token_tile x vocab_tile`` transformed fp32 logits computed from ``hidden`` and ``weight``
into buffers reused by every tile of one call.

A tile of vocabulary columns ``[2, 4)``: the first target lies in it, the second does not.

>>> import torch
>>> _target_logit(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([2, 5]), 2)
tensor([1., 0.])
"""

# ruff: noqa: PLR0917  (autograd.Function.apply and Triton launches take positional arguments only)

from __future__ import annotations

import torch

from opake.kernels._args import LossSpec
from opake.kernels._math import transform_logits_

__all__: list[str] = []

Tensor = torch.Tensor
_F32 = torch.float32


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
