"""Per-example gradients of the output projection inside a linear cross-entropy, never formed.

Example ``i``'s gradient of ``Σ_t g_{i,t} · loss_{i,t}`` (``g`` the upstream gradient of each
token's loss) with respect to the projection ``W`` (``V × H``) is ``G_i = Σ_t d_{i,t} h_{i,t}ᵀ``
with ``d_{i,t} = g_{i,t} · ∂loss_{i,t}/∂z_{i,t}`` the gradient of the raw logits. Materialising
``d`` costs ``B·T·V`` numbers and ``G_i`` ``V·H`` per example; :class:`LinearCEExampleGrads`
needs neither. Vocabulary tile by vocabulary tile it recomputes the logits from ``h`` and ``W``
(exactly as the chunked loss does) and accumulates:

- the squared norm ``‖G_i‖²``, by the ghost identity ``Σ_{t,s} (d_t·d_s)(h_t·h_s)`` (a ``T × T``
  Gram matrix per example, summed over tiles) or by the per-example gradient of each tile
  (``vt × H``), whichever costs less (:func:`lce_ghost_is_cheaper`);
- the clipped sum ``Σ_i c_i G_i`` (one ``vt × H`` product per tile);
- ``d`` gathered at given vocabulary columns (or contracted with given rows), which is what the
  inner product with another use of the same matrix needs: a tied input embedding
  ``Σ_s onehot(id_s) e_sᵀ`` gives ``⟨G_i, E_i⟩ = Σ_{t,s} d_t[id_s] (h_t·e_s)``.

At most one ``token_tile × vocab_tile`` logits tile exists at a time (and, on the materialised
route, one ``vocab_tile × H`` gradient tile). This is what lets the book-keeping engine clip
per example with a loss-only forward (no logits tensor anywhere).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from opake.core.errors import ConfigurationError
from opake.kernels._args import LossSpec
from opake.kernels._math import transform_grad_, transform_logits_
from opake.kernels.chunked import _example_certify, _logit_tiles, _loss_cores
from opake.kernels.chunked._example_args import (
    ROUTES,
    lce_ghost_is_cheaper,
    prepare,
    token_grads_of,
)
from opake.kernels.chunked._kept import (
    KeptLogitGrads,
    gram_form_weighted_sum,
    kept_hidden_grad,
    kept_norms,
    kept_weighted_sum,
)

if TYPE_CHECKING:
    from opake.dpsgd.bookkeeping import OuterSum, PieceCert

__all__ = [
    "ROUTES",
    "LinearCEExampleGrads",
    "lce_ghost_is_cheaper",
    "linear_cross_entropy_example_grads",
    "prepare",
    "token_grads_of",
]

Tensor = torch.Tensor
_F32 = torch.float32


class LinearCEExampleGrads:
    """Example ``i``'s gradient ``G_i`` of the projection weight (and bias) of a linear CE.

    Built by :func:`linear_cross_entropy_example_grads`; holds ``hidden`` (``[B, T, H]``),
    ``weight``, ``labels``, the upstream token gradients and the per-token log-sum-exps (one
    vocabulary pass, done on first use). Every method works tile by tile, or from the logit
    gradients a recorded forward kept (``kept``, see :mod:`._kept`: no logit recomputed).
    """

    def __init__(
        self,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        token_grads: Tensor,
        *,
        bias: Tensor | None,
        spec: LossSpec,
        tiles: tuple[int, int] | None,
        route: str,
        lse: Tensor | None = None,
        kept: KeptLogitGrads | None = None,
    ) -> None:
        self.hidden = hidden
        self._kept = kept
        self.weight = weight
        self.bias = bias
        self.labels = labels
        self.token_grads = token_grads
        self.spec = spec
        self.route = route
        batch, steps, _ = hidden.shape
        vocab = weight.shape[0]
        tt, vt = tiles if tiles is not None else (max(1, batch * steps), vocab)
        # whole examples per group (the Gram route needs an example's tokens together); when one
        # example has more tokens than the token tile, narrow the vocabulary tile instead
        # (and no more examples than their two T × T Gram matrices fit the tile's fp32 budget)
        grams = max(1, (tt * vt) // (2 * max(1, steps) ** 2))
        self._group = max(1, min(batch, tt // max(1, steps), grams))
        rows = self._group * max(1, steps)
        self._vt = max(1, min(vocab, (tt * vt) // rows)) if rows > tt else vt
        self._tiles = (tt, vt)
        self._lse: Tensor | None = lse  # per-token log-sum-exps, when the forward kept them
        self._norms: tuple[Tensor, Tensor | None] | None = None
        self._bias_grads: Tensor | None = None
        self._token_sq: Tensor | None = None  # Σ_v d_{i,t,v}² [B, T], from the norms' pass

    @property
    def batch(self) -> int:
        """Number of examples ``B``."""
        return int(self.hidden.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's shape ``(V, H)``."""
        return int(self.weight.shape[0]), int(self.weight.shape[1])

    def __repr__(self) -> str:
        b, t, h = (int(n) for n in self.hidden.shape)
        return (
            f"LinearCEExampleGrads(batch={b}, tokens={t}, hidden={h}, vocab={self.shape[0]}, "
            f"route={self.route!r})"
        )

    # ------------------------------------------------------------------ tiles
    def _groups(self) -> list[tuple[int, int]]:
        return [(e0, min(self.batch, e0 + self._group)) for e0 in range(0, self.batch, self._group)]

    def _lse_all(self) -> Tensor:
        """Per-token log-sum-exp of the transformed logits ``[B·T]`` (fp32; cached)."""
        if self._lse is None:
            h2 = self.hidden.reshape(-1, self.hidden.shape[-1])
            with torch.no_grad():
                _tok, lse, _ = _loss_cores.lce_forward(
                    h2, self.weight, self.bias, self.labels.reshape(-1), self.spec, self._tiles
                )
            self._lse = lse
        return self._lse

    def _dlogit_tiles(
        self,
        e0: int,
        e1: int,
        tg: Tensor,
        hidden: Tensor | None = None,
        lse_all: Tensor | None = None,
    ) -> Iterator[tuple[int, int, Tensor]]:
        """Yield ``(v0, v1, d)``: the raw-logit gradients ``[e1-e0, T, vt]`` (fp32) per tile.

        ``d`` lives in a reused buffer: consume it before advancing.
        """
        hidden = self.hidden if hidden is None else hidden
        steps, hsize = hidden.shape[1], hidden.shape[2]
        vocab = self.weight.shape[0]
        if self._kept is not None and self._kept.u is not None:  # one tile, scaled
            u = self._kept.u.view(-1, steps, vocab)[e0:e1]
            yield 0, vocab, u * tg[e0:e1].unsqueeze(2)
            return
        lse_all = self._lse_all() if lse_all is None else lse_all
        rows = (e1 - e0) * steps
        h = hidden[e0:e1].reshape(rows, hsize)
        y = self.labels[e0:e1].reshape(rows)
        lse = lse_all[e0 * steps : e1 * steps]
        g = tg[e0:e1].reshape(rows)
        bufs = _logit_tiles._TileBuffers(
            rows, self._vt, h.dtype, h.device, extra=self.spec.softcap is not None
        )
        for v0 in range(0, vocab, self._vt):
            v1 = min(vocab, v0 + self._vt)
            b = None if self.bias is None else self.bias[v0:v1]
            z = bufs.logits(h, self.weight[v0:v1], b, self.spec)
            scratch = None if bufs.t is None else bufs.view(bufs.t, *z.shape)
            d = _logit_tiles._dlogits_(z, y, lse, g, v0, vocab, self.spec, scratch)
            yield v0, v1, d.view(e1 - e0, steps, v1 - v0)

    # ------------------------------------------------------------------ norms
    def sq_norms(self) -> tuple[Tensor, Tensor | None]:
        """``(‖G_i‖² for the weight [B], for the bias [B] or None)`` in fp32 (cached)."""
        if self._norms is None:
            with torch.no_grad():
                self._norms = self._sq_norms(None)
        return self._norms

    def certificate(self) -> PieceCert:
        """The clipping certificate (:mod:`._example_certify`; kept logit gradients only)."""
        return _example_certify.certificate(self)

    def certified_inner(self, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        """The certified inner product with another use ``Σ_s a_s ⊗ b_s`` of the weight."""
        return _example_certify.certified_inner(self, a, b)

    def outer_view(self) -> OuterSum:
        """The ``OuterSum`` ``(u, g ⊙ h)`` the certificate is proved from, which the book-keeping
        engine regroups per privacy unit (``units=``); see :func:`._example_certify.outer_view`
        for what that costs."""
        return _example_certify.outer_view(self)

    def hidden_grad(self) -> Tensor:
        """``∂(Σ token_grads · loss)/∂hidden`` ``[B, T, H]`` (fp32), computed in the same tile
        pass as the norms (which are then cached): the backward of a book-kept loss."""
        kept = self._kept
        with torch.no_grad():
            if kept is not None and (kept.u is not None or kept.hidden_grad is not None):
                if kept.u is None:  # the Gram form: its norms need the kept Gram matrices now
                    self._norms = self._sq_norms(None)
                grad = kept_hidden_grad(kept, self.weight, self.token_grads)
                return grad.view(self.hidden.shape)
            grad = torch.zeros(self.hidden.shape, dtype=_F32, device=self.hidden.device)
            self._norms = self._sq_norms(grad)
        return grad

    def bias_grads(self) -> Tensor | None:
        """The per-example bias gradients ``[B, V]`` (fp32; ``None`` without a bias)."""
        self.sq_norms()
        return self._bias_grads

    def _sq_norms(self, hidden_grad: Tensor | None) -> tuple[Tensor, Tensor | None]:
        batch, steps, hsize = self.hidden.shape
        dev = self.hidden.device
        w_sq = torch.zeros(batch, dtype=_F32, device=dev)
        gb = None
        if self.bias is not None:
            gb = torch.zeros(batch, self.shape[0], dtype=_F32, device=dev)
            self._bias_grads = gb
        token_sq = torch.zeros(batch, steps, dtype=_F32, device=dev)
        self._token_sq = token_sq
        kept = self._kept if hidden_grad is None else None  # the tile pass forms that gradient
        if kept is not None and batch and steps:
            w_sq, self._token_sq, gb = kept_norms(
                kept, self.hidden, self.token_grads, route=self.route, bias=gb is not None
            )
            self._bias_grads = gb
        if batch == 0 or steps == 0 or kept is not None:
            return w_sq, None if gb is None else gb.square().sum(1)
        ghost = self.route == "ghost"
        for e0, e1 in self._groups():
            hf = self.hidden[e0:e1].to(_F32)
            gram_d = torch.zeros(e1 - e0, steps, steps, dtype=_F32, device=dev) if ghost else None
            gh = None if hidden_grad is None else hidden_grad[e0:e1].view(-1, hsize)
            for v0, v1, d in self._dlogit_tiles(e0, e1, self.token_grads):
                if gram_d is None:  # on the Gram route: its diagonal, below
                    token_sq[e0:e1] += d.square().sum(-1)
                if gh is not None:
                    w = self.weight[v0:v1]
                    gh.addmm_(d.view(-1, v1 - v0), w if w.dtype == _F32 else w.float())
                if gb is not None:
                    gb[e0:e1, v0:v1] = d.sum(1)
                if gram_d is not None:
                    gram_d.baddbmm_(d, d.transpose(1, 2))
                else:
                    for j in range(e1 - e0):  # one vt × H gradient tile at a time
                        w_sq[e0 + j] += torch.mm(d[j].t(), hf[j]).square().sum()
            if gram_d is not None:
                token_sq[e0:e1] = gram_d.diagonal(dim1=1, dim2=2)
                gram_h = torch.bmm(hf, hf.transpose(1, 2))
                # the T² products summed in fp64: only the Gram entries round (the bound of
                # abs_norms covers them)
                ghost_sq = gram_d.mul_(gram_h).sum(dim=(1, 2), dtype=torch.float64)
                w_sq[e0:e1] = ghost_sq.clamp_min(0.0).to(_F32)
        return w_sq, None if gb is None else gb.square().sum(1)

    # ------------------------------------------------------------------ certification
    def abs_norms(self) -> Tensor:
        """``Σ_t ‖d_{i,t}‖ ‖h_{i,t}‖`` per example ``[B]`` (fp64): an upper bound of ``‖G_i‖``
        that cancellation between tokens cannot shrink, and the scale of the rounding error of
        the Gram norm (what the book-keeping engine's certified clipping needs)."""
        self.sq_norms()
        assert self._token_sq is not None
        wide = torch.float64 if self.hidden.dtype == torch.float64 else _F32
        h_norm = torch.linalg.vector_norm(self.hidden, dim=-1, dtype=wide)
        norms: Tensor = (self._token_sq.double().sqrt() * h_norm.double()).sum(dim=1)
        return norms

    def example_rows(self, index: int, start: int, stop: int) -> Tensor:
        """Rows ``start:stop`` (vocabulary entries) of example ``index``'s weight gradient,
        fp64 ``[stop - start, H]``: ``d`` recomputed for that slice, then ``dᵀ h`` in fp64."""
        return _example_certify.example_rows(self, index, start, stop)

    # ------------------------------------------------------------------ clipped sum
    def weighted_sum(
        self, weights: Tensor, keep: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """``Σ_i w_i G_i`` for the weight ``(V, H)`` and the bias ``(V,)`` (fp32).

        Examples with ``keep[i]`` false contribute exactly zero, even when their hidden states
        or token gradients are not finite.
        """
        if tuple(weights.shape) != (self.batch,):
            raise ConfigurationError(
                f"weighted_sum: weights of shape {tuple(weights.shape)}; expected ({self.batch},)"
            )
        kept = self._kept
        if kept is not None and kept.u is None and kept.gram is not None and self.bias is None:
            with torch.no_grad():  # replay the forward's tiles: the u the norms came from
                gw = gram_form_weighted_sum(
                    kept,
                    self.hidden,
                    self.weight,
                    self.labels,
                    self.spec,
                    token_grads=self.token_grads,
                    weights=weights,
                    keep=keep,
                )
                return gw, None
        if self._kept is not None and self._kept.u is not None:
            with torch.no_grad():
                bias = self.bias is not None
                return kept_weighted_sum(
                    self._kept, self.hidden, self.token_grads, weights, keep, bias=bias
                )
        with torch.no_grad():
            w = weights.to(_F32)
            tg = self.token_grads
            hidden = self.hidden
            lse = self._lse_all()
            if keep is not None:
                # a dropped example's hidden states, upstream gradients and log-sum-exps may be
                # NaN/Inf: zero them all, so that it contributes exactly zero
                w = torch.where(keep, w, 0.0)
                tg = torch.where(keep[:, None], tg, 0.0)
                hidden = torch.where(keep[:, None, None], hidden, 0.0)
                rows = keep.repeat_interleave(hidden.shape[1])
                lse = torch.where(rows, lse, 0.0)
            tg = tg * w[:, None]
            vocab, hsize = self.shape
            dev = hidden.device
            # fp64 hidden states: contracted in fp64 and rounded to fp32 once (an fp32 copy of
            # them could overflow, or carry a subnormal-range error the scaled side multiplies)
            wide = torch.float64 if hidden.dtype == torch.float64 else _F32
            gw = torch.zeros(vocab, hsize, dtype=wide, device=dev)
            gb = None if self.bias is None else torch.zeros(vocab, dtype=_F32, device=dev)
            for e0, e1 in self._groups():
                hf = hidden[e0:e1].reshape(-1, hsize).to(wide)
                for v0, v1, d in self._dlogit_tiles(e0, e1, tg, hidden, lse):
                    d2 = d.reshape(-1, v1 - v0)
                    gw[v0:v1].addmm_(d2.t().to(wide), hf)
                    if gb is not None:
                        gb[v0:v1] += d2.sum(0)
        return gw.to(_F32), gb

    # ------------------------------------------------------------------ cross terms
    def project(self, other: Tensor) -> Tensor:
        """``[B, T, S]``: each token's raw-logit gradient against ``S`` vocabulary directions.

        ``other`` is int64 vocabulary ids ``[B, S]`` (the gradient gathered at those columns) or
        dense rows ``[B, S, V]`` (``Σ_v d_{t,v} · other_{s,v}``, tile by tile).
        """
        with torch.no_grad():
            if other.dtype in (torch.int64, torch.int32):
                return self._gather(other.long())
            return self._contract(other)

    def _gather(self, ids: Tensor) -> Tensor:
        spec = self.spec
        vocab = self.weight.shape[0]
        batch, steps = self.labels.shape
        if ids.dim() != 2 or ids.shape[0] != batch:
            raise ConfigurationError(
                f"project(ids): ids of shape {tuple(ids.shape)}; expected ({batch}, S)"
            )
        safe = ids.clamp(0, vocab - 1)
        rows = self.weight[safe]  # [B, S, H]
        z = torch.bmm(self.hidden, rows.transpose(1, 2)).to(_F32)  # raw logits at the ids
        if self.bias is not None:
            z = z + self.bias[safe].to(_F32)[:, None, :]
        transform_logits_(z, spec)
        lse = self._lse_all().view(batch, steps, 1)
        g = self.token_grads.to(_F32)[..., None]
        eps = spec.smoothing
        hit = (self.labels[..., None] == ids[:, None, :]).to(_F32)
        d = g * (torch.exp(z - lse) - eps / vocab - (1.0 - eps) * hit)
        return transform_grad_(d, z, spec)

    def _contract(self, other: Tensor) -> Tensor:
        batch, steps, _ = self.hidden.shape
        vocab = self.weight.shape[0]
        if other.dim() != 3 or other.shape[0] != batch or other.shape[2] != vocab:
            raise ConfigurationError(
                f"project(rows): rows of shape {tuple(other.shape)}; expected ({batch}, S, {vocab})"
            )
        out = torch.zeros(batch, steps, other.shape[1], dtype=_F32, device=self.hidden.device)
        for e0, e1 in self._groups():
            for v0, v1, d in self._dlogit_tiles(e0, e1, self.token_grads):
                out[e0:e1].baddbmm_(d, other[e0:e1, :, v0:v1].to(_F32).transpose(1, 2))
        return out

    def inner_outer(self, a: Tensor, b: Tensor) -> Tensor:
        """``⟨G_i, Σ_s a_s ⊗ b_s⟩`` per example ``[B]`` (fp32) for another use of the weight.

        ``a`` is int64 ids ``[B, S]`` (one-hot rows: an embedding lookup) or ``[B, S, V]``;
        ``b`` is ``[B, S, H]``. E.g. a tied embedding's gradient ``Σ_s onehot(id_s) ⊗ e_s``.
        """
        with torch.no_grad():
            proj = self.project(a)  # [B, T, S]
            gram = torch.bmm(self.hidden.to(_F32), b.to(_F32).transpose(1, 2))
            return (proj * gram).sum(dim=(1, 2), dtype=torch.float64)


def linear_cross_entropy_example_grads(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    token_grads: Tensor,
    *,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    logit_scale: float | None = None,
    logit_divisor: float | None = None,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    chunk_size: bool | int = True,
    route: str = "auto",
) -> LinearCEExampleGrads:
    """The per-example gradients of ``weight`` (and ``bias``) in a linear cross-entropy, implicit.

    ``hidden [B, T, H]``, ``labels [B, T]`` and ``token_grads [B, T]`` — the upstream gradient
    of each token's loss (what a backward pass hands the ``reduction="none"`` per-token losses;
    ``1/count_i`` for example ``i``'s mean loss) — with the same loss options as
    :func:`~opake.kernels.chunked.linear_cross_entropy`. ``route`` picks the norm computation:
    ``"ghost"``, ``"materialised"`` or ``"auto"`` (:func:`lce_ghost_is_cheaper`).

    >>> import torch
    >>> h, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    >>> y, g = torch.tensor([[0, 1, 2], [3, 4, -100]]), torch.full((2, 3), 0.5)
    >>> grads = linear_cross_entropy_example_grads(h, w, y, g, chunk_size=2)
    >>> def loss(w, h, y):
    ...     return 0.5 * torch.nn.functional.cross_entropy(h @ w.T, y, reduction="sum")
    >>> want = torch.stack([torch.func.grad(loss)(w, h[i], y[i]) for i in range(2)])
    >>> torch.allclose(grads.sq_norms()[0], want.square().sum(dim=(1, 2)), rtol=1e-5)
    True
    """
    hidden, weight, labels, bias, spec, tiles, route = prepare(
        hidden,
        weight,
        labels,
        bias,
        ignore_index=ignore_index,
        logit_scale=logit_scale,
        logit_divisor=logit_divisor,
        softcap=softcap,
        label_smoothing=label_smoothing,
        chunk_size=chunk_size,
        route=route,
    )
    return LinearCEExampleGrads(
        hidden.detach(),
        weight.detach(),
        labels,
        token_grads_of(token_grads, labels, ignore_index),
        bias=None if bias is None else bias.detach(),
        spec=spec,
        tiles=tiles,
        route=route,
    )
