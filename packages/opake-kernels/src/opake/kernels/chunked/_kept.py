"""The recorded linear cross-entropy's kept logit gradients: one vocabulary pass per step.

When one vocabulary tile spans the whole vocabulary, the forward pass has each token's
probabilities at hand right after its log-sum-exp. It then keeps ``u_t = ∂loss_t/∂z_t`` — the
gradient of the raw logits for a unit upstream gradient (fp32 ``[N, V]``, zero on ignored
tokens) — and the hidden states' gradient for that unit gradient (``u_t W``). Every later use
is linear in the upstream gradients ``g_t`` (``d_t = g_t u_t``), so none recomputes a logit:

- the hidden states' gradient: ``g_t · (u_t W)`` (rows scaled);
- the norms: the Gram route's ``(d_t·d_s) = g_t g_s (u_t·u_s)``, the materialised route's
  ``Uᵢᵀ (g ⊙ Hᵢ)`` per example, each token's ``‖d_t‖² = g_t² ‖u_t‖²``;
- the clipped sum ``Σ_i c_i G_i = Uᵀ ((c g) ⊙ H)``: one matrix product.

``u`` costs ``4·N·V`` bytes, no more than the non-private head keeps for its logits and
log-softmax; it is kept only while that fits an eighth of the device's available memory
(:func:`keeps_logit_grads`), else the tiles are recomputed as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opake.kernels._args import LossSpec
from opake.kernels._math import token_loss, transform_logits_
from opake.kernels.chunked._cores import _subtract_target, _target_logit
from opake.kernels.chunked._workspace import available_memory, workspace_budget

__all__ = [
    "KeptLogitGrads",
    "keeps_logit_grads",
    "kept_forward",
    "kept_hidden_grad",
    "kept_norms",
    "kept_weighted_sum",
]

Tensor = torch.Tensor
_F32 = torch.float32
_FRACTION = 8  # kept gradients take at most this fraction of the available memory


@dataclass
class KeptLogitGrads:
    """What the forward kept: ``u`` ``[N, V]`` and ``u W`` ``[N, H]`` (fp32; ``None`` when the
    hidden states need no gradient)."""

    u: Tensor
    hidden_grad: Tensor | None


def keeps_logit_grads(
    tokens: int, vocab: int, tiles: tuple[int, int] | None, device: torch.device
) -> bool:
    """Whether the forward keeps the logit gradients (one tile spans the vocabulary and
    ``4·tokens·vocab`` bytes fit an eighth of the available memory).

    >>> import torch
    >>> keeps_logit_grads(8, 50, (8, 50), torch.device("cpu"))
    True
    >>> keeps_logit_grads(8, 50, (8, 25), torch.device("cpu"))
    False
    """
    if tiles is not None and tiles[1] < vocab:
        return False
    return 4 * tokens * vocab <= available_memory(device) // _FRACTION


def _unit_dprobs_(z: Tensor, y: Tensor, scale: Tensor, mask: Tensor, spec: LossSpec) -> None:
    """Probabilities *z* (a tile) → the gradient of the transformed logits for a unit upstream
    gradient, in place: ``mask·(p - ε/V - (1-ε)·onehot)``, where ``z·scale`` is ``mask·p``."""
    z.mul_(scale.unsqueeze(1))
    eps = spec.smoothing
    if eps:
        z.sub_((eps / z.shape[1]) * mask.unsqueeze(1))
    _subtract_target(z, y, 0, (1.0 - eps) * mask)


def kept_forward(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    spec: LossSpec,
    *,
    bias: Tensor | None,
    tiles: tuple[int, int] | None,
    with_hidden_grad: bool,
) -> tuple[Tensor, Tensor, KeptLogitGrads]:
    """Per-token losses (masked), log-sum-exps (fp32 ``[N]``) and the kept gradients.

    ``hidden`` ``[N, H]``; each token tile spans the whole vocabulary and its logits are
    written straight into its rows of ``u``.
    """
    n, hsize = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    tt = max(1, min(n, tiles[0] if tiles is not None else n))
    u = torch.empty(n, vocab, dtype=_F32, device=dev)
    lse = torch.empty(n, dtype=_F32, device=dev)
    tok = torch.empty(n, dtype=_F32, device=dev)
    gh = torch.empty(n, hsize, dtype=_F32, device=dev) if with_hidden_grad else None
    low = hidden.dtype != _F32
    raw = torch.empty(tt * vocab, dtype=hidden.dtype, device=dev) if low else None
    cap = spec.softcap
    tanh = torch.empty(tt * vocab, dtype=_F32, device=dev) if cap is not None else None
    for t0 in range(0, n, tt):
        t1 = min(n, t0 + tt)
        h, y, z = hidden[t0:t1], labels[t0:t1], u[t0:t1]
        out = z if raw is None else raw[: (t1 - t0) * vocab].view(t1 - t0, vocab)
        if bias is None:
            torch.mm(h, weight.t(), out=out)
        else:
            torch.addmm(bias, h, weight.t(), out=out)
        if raw is not None:
            z.copy_(out)
        transform_logits_(z, spec)
        zy = _target_logit(z, y, 0)
        zs = z.sum(1) if spec.smoothing else None
        t = None
        if cap is not None and tanh is not None:
            t = torch.div(z, cap, out=tanh[: z.numel()].view_as(z))
        m = z.amax(1)
        run = m + torch.log(z.sub_(m.unsqueeze(1)).exp_().sum(1))
        lse[t0:t1] = run
        mask = (y != spec.ignore_index).to(_F32)
        loss = token_loss(run, zy, zs, vocab, spec)
        tok[t0:t1] = torch.where(mask > 0, loss, torch.zeros_like(loss))
        # p = exp(z - m)·exp(m - lse): exp(z - lse) as the recomputing path forms it, with the
        # same rounding of lse (both differences are exact near the maximum)
        _unit_dprobs_(z, y, mask * torch.exp(m - run), mask, spec)
        if t is not None:
            z.mul_(t.mul_(t).neg_().add_(1.0))
        if spec.mult is not None:
            z.mul_(spec.mult)
        if gh is not None:
            zc = z if raw is None else out.copy_(z)
            gh[t0:t1] = torch.mm(zc, weight)
    return tok, lse, KeptLogitGrads(u, gh)


def kept_hidden_grad(kept: KeptLogitGrads, weight: Tensor, token_grads: Tensor) -> Tensor:
    """``∂(Σ g·loss)/∂hidden`` ``[N, H]`` (fp32): the kept ``u W`` with rows scaled by ``g``."""
    base = kept.hidden_grad
    if base is None:
        w = weight if weight.dtype == _F32 else weight.float()
        base = kept.u @ w
    return base * token_grads.reshape(-1, 1)


def _example_group(steps: int, device: torch.device) -> int:
    """Examples per group on the Gram route: their two ``T × T`` fp32 matrices fit the
    workspace."""
    return max(1, workspace_budget(device) // (8 * max(1, steps) ** 2))


def kept_norms(
    kept: KeptLogitGrads,
    hidden: Tensor,
    token_grads: Tensor,
    *,
    route: str,
    bias: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(‖G_i‖² [B], ‖d_{i,t}‖² [B, T], the bias gradients [B, V] or None)`` in fp32.

    On the Gram route the token norms are the diagonal of ``d``'s Gram matrix, as on the
    recomputing path; the ``T²`` products are summed in fp64 there too.
    """
    batch, steps, hsize = hidden.shape
    vocab = kept.u.shape[1]
    dev = hidden.device
    u3 = kept.u.view(batch, steps, vocab)
    tg = token_grads
    w_sq = torch.zeros(batch, dtype=_F32, device=dev)
    token_sq = torch.zeros(batch, steps, dtype=_F32, device=dev)
    gb = torch.bmm(tg.unsqueeze(1), u3).squeeze(1) if bias else None
    if batch == 0 or steps == 0:
        return w_sq, token_sq, gb
    if route == "ghost":
        group = _example_group(steps, dev)
        for e0 in range(0, batch, group):
            e1 = min(batch, e0 + group)
            gram_d = torch.bmm(u3[e0:e1], u3[e0:e1].transpose(1, 2))
            g = tg[e0:e1]
            gram_d.mul_(g.unsqueeze(2) * g.unsqueeze(1))
            token_sq[e0:e1] = gram_d.diagonal(dim1=1, dim2=2)
            hf = hidden[e0:e1].to(_F32)
            gram_d.mul_(torch.bmm(hf, hf.transpose(1, 2)))
            ghost_sq = gram_d.sum(dim=(1, 2), dtype=torch.float64)
            w_sq[e0:e1] = ghost_sq.clamp_min(0.0).to(_F32)
        return w_sq, token_sq, gb
    # materialised: Uᵢᵀ (g ⊙ Hᵢ) per example, in vocabulary tiles of the workspace's size
    token_sq = tg.square() * torch.linalg.vecdot(u3, u3)
    vt = max(1, min(vocab, workspace_budget(dev) // (4 * max(1, hsize))))
    for i in range(batch):
        hs = hidden[i].to(_F32) * tg[i].unsqueeze(1)
        total = torch.zeros((), dtype=_F32, device=dev)
        for v0 in range(0, vocab, vt):
            total += torch.mm(u3[i, :, v0 : v0 + vt].t(), hs).square().sum()
        w_sq[i] = total
    return w_sq, token_sq, gb


def kept_weighted_sum(
    kept: KeptLogitGrads,
    hidden: Tensor,
    token_grads: Tensor,
    weights: Tensor,
    keep: Tensor | None,
    *,
    bias: bool,
) -> tuple[Tensor, Tensor | None]:
    """``Σ_i w_i G_i = Uᵀ ((w g) ⊙ H)`` for the weight ``(V, H)`` and ``Uᵀ (w g)`` for the bias.

    Rows of examples with ``keep[i]`` false are left out of the products (their hidden states
    or kept gradients may be NaN/Inf): they contribute exactly zero.
    """
    steps, hsize = hidden.shape[1], hidden.shape[2]
    scale = (weights.to(_F32).unsqueeze(1) * token_grads).reshape(-1)
    h2 = hidden.reshape(-1, hsize)
    u = kept.u
    if keep is not None and not bool(keep.all()):
        rows = keep.repeat_interleave(steps).nonzero().squeeze(1)
        u, h2, scale = u.index_select(0, rows), h2.index_select(0, rows), scale[rows]
    hs = h2.to(_F32) * scale.unsqueeze(1)
    gw = u.t() @ hs
    gb = u.t() @ scale if bias else None
    return gw, gb
