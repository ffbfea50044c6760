"""The recorded linear cross-entropy's kept logit gradients: one vocabulary pass per step.

The forward pass computes each token tile's logits over the whole vocabulary (written straight
into the kept rows: no workspace bound on them), so each token's probabilities are at hand right
after its log-sum-exp. It then keeps ``u_t = ∂loss_t/∂z_t`` — the
gradient of the raw logits for a unit upstream gradient (fp32 ``[N, V]``, zero on ignored
tokens) — and the hidden states' gradient for that unit gradient (``u_t W``). Every later use
is linear in the upstream gradients ``g_t`` (``d_t = g_t u_t``), so none recomputes a logit:

- the hidden states' gradient: ``g_t · (u_t W)`` (rows scaled);
- the norms: the Gram route's ``(d_t·d_s) = g_t g_s (u_t·u_s)``, the materialised route's
  ``Uᵢᵀ (g ⊙ Hᵢ)`` per example, each token's ``‖d_t‖² = g_t² ‖u_t‖²``;
- the clipped sum ``Σ_i c_i G_i = Uᵀ ((c g) ⊙ H)``: one matrix product.

``u`` costs ``4·N·V`` bytes, no more than the non-private head keeps for its logits and
log-softmax; it is kept only while that fits a quarter of the device's available memory
(:func:`keeps_logit_grads`). Otherwise, when one vocabulary tile spans the vocabulary, the
forward keeps ``u W`` and each example's Gram matrix of ``u`` (the "Gram form"), and only the
clipped sum recomputes the tiles; else the tiles are recomputed as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from opake.kernels._args import LossSpec
from opake.kernels._math import token_loss, transform_logits_
from opake.kernels.chunked._logit_tiles import _subtract_target, _target_logit
from opake.kernels.chunked._workspace import available_memory, workspace_budget

__all__ = [
    "KeptLogitGrads",
    "gram_form_weighted_sum",
    "keeps_logit_grads",
    "kept_forward",
    "kept_hidden_grad",
    "kept_norms",
    "kept_weighted_sum",
    "wide_contraction",
]

Tensor = torch.Tensor
_F32 = torch.float32
_FRACTION = 4  # kept gradients take at most this fraction of the available memory


@dataclass
class KeptLogitGrads:
    """What the forward kept (fp32): ``u`` ``[N, V]``, or only its Gram matrix per example
    ``[B, T, T]`` (``gram``, when ``u`` does not fit); ``u W`` ``[N, H]`` (``None`` when the
    hidden states need no gradient)."""

    u: Tensor | None
    hidden_grad: Tensor | None
    gram: Tensor | None = None
    tile: int = 0  # token rows per forward tile (the Gram form's clipped sum replays them)


def keeps_logit_grads(
    shape: tuple[int, int, int],
    tiles: tuple[int, int] | None,
    device: torch.device,
    *,
    gram_ok: bool = False,
) -> str | None:
    """What the forward keeps for hidden states ``[B, T]`` and a vocabulary ``V``
    (``shape = (B, T, V)``) and the chunked kernel's ``tiles``: ``"u"`` when ``4·B·T·V``
    bytes fit a quarter of the available memory (whatever the tiles); else ``"gram"``
    (``u W`` and each example's Gram matrix of ``u``; the clipped sum then recomputes the
    tiles once) when ``gram_ok`` (the Gram route, no bias), one vocabulary tile spans the
    vocabulary and one token tile holds a whole example; else ``None``.

    >>> import torch
    >>> keeps_logit_grads((2, 4, 50), (8, 25), torch.device("cpu"))
    'u'
    """
    batch, steps, vocab = shape
    if 4 * batch * steps * vocab <= available_memory(device) // _FRACTION:
        return "u"
    if tiles is not None and tiles[1] < vocab:
        return None
    fits = tiles is None or steps <= tiles[0]
    return "gram" if gram_ok and fits else None


def _unit_dprobs_(z: Tensor, y: Tensor, scale: Tensor, mask: Tensor, spec: LossSpec) -> None:
    """Probabilities *z* (a tile) → the gradient of the transformed logits for a unit upstream
    gradient, in place: ``mask·(p - ε/V - (1-ε)·onehot)``, where ``z·scale`` is ``mask·p``."""
    z.mul_(scale.unsqueeze(1))
    eps = spec.smoothing
    if eps:
        z.sub_((eps / z.shape[1]) * mask.unsqueeze(1))
    _subtract_target(z, y, 0, (1.0 - eps) * mask)


def _unit_grads_(
    z: Tensor, y: Tensor, spec: LossSpec, tanh: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Transformed logits *z* (fp32, a tile) → the raw-logit gradients for a unit upstream
    gradient, in place; returns the masked token losses and the log-sum-exps."""
    vocab = z.shape[1]
    zy = _target_logit(z, y, 0)
    zs = z.sum(1) if spec.smoothing else None
    t = None
    if spec.softcap is not None and tanh is not None:
        t = torch.div(z, spec.softcap, out=tanh[: z.numel()].view_as(z))
    m = z.amax(1)
    run = m + torch.log(z.sub_(m.unsqueeze(1)).exp_().sum(1))
    mask = (y != spec.ignore_index).to(_F32)
    loss = token_loss(run, zy, zs, vocab, spec)
    # p = exp(z - m)·exp(m - lse): exp(z - lse) as the recomputing path forms it, with the
    # same rounding of lse (both differences are exact near the maximum)
    _unit_dprobs_(z, y, mask * torch.exp(m - run), mask, spec)
    if t is not None:
        z.mul_(t.mul_(t).neg_().add_(1.0))
    if spec.mult is not None:
        z.mul_(spec.mult)
    return torch.where(mask > 0, loss, torch.zeros_like(loss)), run


def _unit_grad_tiles(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    spec: LossSpec,
    *,
    bias: Tensor | None,
    tile: int,
    into: Tensor,
) -> Iterator[tuple[int, int, Tensor, Tensor, Tensor, Tensor]]:
    """Yield ``(t0, t1, u, raw, losses, lse)`` per token tile: ``u`` the raw-logit gradients
    of rows ``t0:t1`` for a unit upstream gradient (fp32, rows ``t0:t1`` of *into* when it has
    a row per token, else its first rows, reused), ``raw`` the logits' matmul output (the input
    dtype's buffer for half precision, else ``u``). The same arguments yield the same tiles."""
    n, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    low = hidden.dtype != _F32
    raw = torch.empty(tile * vocab, dtype=hidden.dtype, device=dev) if low else None
    tanh = torch.empty(tile * vocab, dtype=_F32, device=dev) if spec.softcap is not None else None
    for t0 in range(0, n, tile):
        t1 = min(n, t0 + tile)
        z = into[t0:t1] if into.shape[0] == n else into[: t1 - t0]
        out = z if raw is None else raw[: (t1 - t0) * vocab].view(t1 - t0, vocab)
        if bias is None:
            torch.mm(hidden[t0:t1], weight.t(), out=out)
        else:
            torch.addmm(bias, hidden[t0:t1], weight.t(), out=out)
        if raw is not None:
            z.copy_(out)
        tok, lse = _unit_grads_(transform_logits_(z, spec), labels[t0:t1], spec, tanh)
        yield t0, t1, z, out, tok, lse


def _tile_rows(
    n: int, vocab: int, tiles: tuple[int, int] | None, gram_steps: int | None, *, scratch: bool
) -> int:
    """Token rows per tile spanning the vocabulary: the chunked kernel's token tile when its
    vocabulary tile spans the vocabulary, else as many rows as its tile has elements. A tile
    that needs no scratch is rows of ``u`` itself: then one tile holds every token (skinny
    products cost up to twice as much per row, and every tile is a few parallel regions of
    elementwise work: with 2 threads, 256-row tiles took twice the CPU time of one tile)."""
    if not scratch:
        return max(1, n)
    rows = n if tiles is None else tiles[0] if tiles[1] >= vocab else tiles[0] * tiles[1] // vocab
    tt = max(1, min(n, rows))
    return max(gram_steps, tt - tt % gram_steps) if gram_steps else tt


def kept_forward(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    spec: LossSpec,
    *,
    bias: Tensor | None,
    tiles: tuple[int, int] | None,
    with_hidden_grad: bool,
    gram_steps: int | None = None,
) -> tuple[Tensor, Tensor, KeptLogitGrads]:
    """Per-token losses (masked), log-sum-exps (fp32 ``[N]``) and the kept gradients.

    ``hidden`` ``[N, H]``; each token tile spans the whole vocabulary and its logits are
    written straight into its rows of ``u``. With ``gram_steps = T`` only each example's Gram
    matrix of ``u`` is kept (tiles of whole examples, in one reused buffer).
    """
    n, hsize = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    scratch = bool(gram_steps) or hidden.dtype != _F32 or spec.softcap is not None
    tt = _tile_rows(n, vocab, tiles, gram_steps, scratch=scratch)
    u = torch.empty(tt if gram_steps and tt < n else n, vocab, dtype=_F32, device=dev)
    gram = None
    if gram_steps:
        gram = torch.empty(n // gram_steps, gram_steps, gram_steps, dtype=_F32, device=dev)
    lse = torch.empty(n, dtype=_F32, device=dev)
    tok = torch.empty(n, dtype=_F32, device=dev)
    gh = torch.empty(n, hsize, dtype=_F32, device=dev) if with_hidden_grad else None
    low = hidden.dtype != _F32
    for t0, t1, z, out, losses, run in _unit_grad_tiles(
        hidden, weight, labels, spec, bias=bias, tile=tt, into=u
    ):
        tok[t0:t1], lse[t0:t1] = losses, run
        if gh is not None:
            gh[t0:t1] = torch.mm(out.copy_(z) if low else z, weight)
        if gram is not None and gram_steps:
            z3 = z.view(-1, gram_steps, vocab)
            torch.bmm(z3, z3.transpose(1, 2), out=gram[t0 // gram_steps : t1 // gram_steps])
    return tok, lse, KeptLogitGrads(None if gram_steps else u, gh, gram, tt)


def gram_form_weighted_sum(
    kept: KeptLogitGrads,
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    spec: LossSpec,
    *,
    token_grads: Tensor,
    weights: Tensor,
    keep: Tensor | None,
) -> Tensor:
    """``Σ_i w_i G_i`` for the Gram form: the forward's tiles recomputed once, exactly as the
    forward formed them (the same ``u`` its Gram matrices, hence the norms, came from), each
    contracted with ``(w g) ⊙ H``. Rows of examples not kept contribute exactly zero."""
    batch, steps, hsize = hidden.shape
    vocab = weight.shape[0]
    h2, n = hidden.reshape(-1, hsize), batch * steps
    scale = (weights.to(_F32).unsqueeze(1) * token_grads).reshape(-1)
    rows = None if keep is None else keep.repeat_interleave(steps)
    if rows is not None:
        scale = torch.where(rows, scale, 0.0)
    # fp64 hidden states: scaled and contracted in fp64, rounded to fp32 once (see
    # wide_contraction)
    wide = torch.float64 if hidden.dtype == torch.float64 else _F32
    gw = torch.zeros(vocab, hsize, dtype=wide, device=hidden.device)
    tt = kept.tile
    buf = torch.empty(min(tt, n), vocab, dtype=_F32, device=hidden.device)
    for t0, t1, z, _out, _tok, _lse in _unit_grad_tiles(
        h2, weight, labels.reshape(-1), spec, bias=None, tile=tt, into=buf
    ):
        hs = h2[t0:t1].to(wide)
        if rows is not None:  # a dropped example's hidden states or u may be NaN/Inf
            z.masked_fill_(~rows[t0:t1].unsqueeze(1), 0.0)
            hs = torch.where(rows[t0:t1].unsqueeze(1), hs, 0.0)
        gw.addmm_(z.t().to(wide), hs * scale[t0:t1].to(wide).unsqueeze(1))
    return gw.to(_F32)


def kept_hidden_grad(kept: KeptLogitGrads, weight: Tensor, token_grads: Tensor) -> Tensor:
    """``∂(Σ g·loss)/∂hidden`` ``[N, H]`` (fp32): the kept ``u W`` with rows scaled by ``g``."""
    base = kept.hidden_grad
    if base is None:
        assert kept.u is not None  # the Gram form keeps u W whenever hidden needs a gradient
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
    recomputing path; the ``T²`` products are summed in fp64 there too. The Gram form
    (``kept.u`` None) has the Gram route and no bias.
    """
    batch, steps, hsize = hidden.shape
    dev = hidden.device
    tg = token_grads
    w_sq = torch.zeros(batch, dtype=_F32, device=dev)
    token_sq = torch.zeros(batch, steps, dtype=_F32, device=dev)
    u3 = None if kept.u is None else kept.u.view(batch, steps, -1)
    gb = None if u3 is None or not bias else torch.bmm(tg.unsqueeze(1), u3).squeeze(1)
    if batch == 0 or steps == 0:
        return w_sq, token_sq, gb
    if route == "ghost" or u3 is None:
        group = _example_group(steps, dev)
        for e0 in range(0, batch, group):
            e1 = min(batch, e0 + group)
            if u3 is None:
                assert kept.gram is not None
                gram_d = kept.gram[e0:e1].clone()
            else:
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
    vocab = u3.shape[2]
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
    assert kept.u is not None  # the Gram form recomputes the tiles for the clipped sum
    scale = (weights.to(_F32).unsqueeze(1) * token_grads).reshape(-1)
    h2 = hidden.reshape(-1, hsize)
    u = kept.u
    if keep is not None and not bool(keep.all()):
        rows = keep.repeat_interleave(steps).nonzero().squeeze(1)
        u, h2, scale = u.index_select(0, rows), h2.index_select(0, rows), scale[rows]
    gb = u.t() @ scale if bias else None
    if h2.dtype == torch.float64:  # scaled and contracted in fp64, rounded to fp32 once
        return wide_contraction(u, h2 * scale.double().unsqueeze(1)), gb
    hs = h2.to(_F32) * scale.unsqueeze(1)
    return u.t() @ hs, gb


def wide_contraction(d: Tensor, hs: Tensor, tile: int = 4096) -> Tensor:
    """``fp32(dᵀ hs)`` for fp32 ``d [N, V]`` and fp64 ``hs [N, H]``: the product in fp64 (tiles
    of ``tile`` rows of ``d`` converted at a time), rounded to fp32 once.

    An fp64 side converted to fp32 *before* it is scaled would carry an absolute error (fp32's
    subnormal range) that the clip factor and the upstream gradient then multiply, or overflow
    to an infinity: the clipping proof (section 7) counts the scaled side as within three
    roundings of ``w·b_t``, which holds only when the scaling comes first.

    >>> import torch
    >>> d, hs = torch.ones(3, 2), torch.full((3, 1), 1e39, dtype=torch.float64)
    >>> wide_contraction(d, hs * 1e-39).tolist()
    [[3.0], [3.0]]
    """
    out = torch.zeros(d.shape[1], hs.shape[1], dtype=torch.float64, device=hs.device)
    for t0 in range(0, d.shape[0], tile):
        out.addmm_(d[t0 : t0 + tile].t().double(), hs[t0 : t0 + tile])
    return out.to(_F32)
