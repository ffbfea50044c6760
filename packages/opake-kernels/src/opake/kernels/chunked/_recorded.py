"""The recorded linear cross-entropy: per-token losses whose backward forms the hidden states'
gradient and the projection's per-example gradients (:class:`LinearCEExampleGrads`), so the
book-keeping engine clips with a loss-only forward.

When one vocabulary tile spans the vocabulary and the logit gradients fit in memory
(:func:`~._kept.keeps_logit_grads`), the forward keeps them (:mod:`._kept`): the backward, the
norms and the clipped sum then compute no logit again. When they do not fit, the forward keeps
what the backward and the Gram-route norms need (the hidden states' gradient for a unit
upstream gradient, each example's Gram matrix of the logit gradients), and only the clipped sum
recomputes the tiles, once. Otherwise (narrower tiles) the backward recomputes each tile once
for the hidden states' gradient and the norms, and the clipped sum once more.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from opake.core.errors import ConfigurationError
from opake.kernels._args import LossSpec
from opake.kernels._autograd import apply
from opake.kernels.chunked import _loss_cores
from opake.kernels.chunked._example_args import kept_ghost_is_cheaper
from opake.kernels.chunked._example_grads import LinearCEExampleGrads
from opake.kernels.chunked._example_grads import prepare as _prepare
from opake.kernels.chunked._example_grads import token_grads_of as _token_grads
from opake.kernels.chunked._kept import KeptLogitGrads, keeps_logit_grads, kept_forward

__all__ = ["RecordedLinearCE", "linear_cross_entropy_recorded"]

Tensor = torch.Tensor
logger = logging.getLogger("opake.kernels")


class RecordedLinearCE:
    """The record of one :func:`linear_cross_entropy_recorded` call.

    After the backward pass, :meth:`example_grads` returns the per-example gradients of the
    projection whose norms that backward already computed (in the tile pass that formed the
    hidden states' gradient: no extra pass over the vocabulary).
    """

    def __init__(
        self,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        *,
        bias: Tensor | None,
        spec: LossSpec,
        tiles: tuple[int, int] | None,
        route: str,
        keep: bool | None = None,
        auto_route: bool = False,
    ) -> None:
        self.hidden = hidden
        self.weight = weight
        self.labels = labels
        self.bias = bias
        self.spec = spec
        self.tiles = tiles
        self.route = route
        #: the route was chosen automatically: re-chosen for the kept gradients if kept
        self.auto_route = auto_route
        self.lse: Tensor | None = None
        self.keep = keep  # keep the logit gradients in the forward (None: when they fit)
        self.kept: KeptLogitGrads | None = None  # set by the forward when it keeps them
        self.grads: LinearCEExampleGrads | None = None  # set by the backward

    def build(self, token_grads: Tensor) -> LinearCEExampleGrads:
        """Per-example gradients for these upstream token gradients (fp32, ignored tokens 0)."""
        return LinearCEExampleGrads(
            self.hidden,
            self.weight,
            self.labels,
            _token_grads(token_grads, self.labels, self.spec.ignore_index),
            bias=self.bias,
            spec=self.spec,
            tiles=self.tiles,
            route=self.route,
            lse=self.lse,
            kept=self.kept,
        )

    def example_grads(self, token_grads: Tensor) -> LinearCEExampleGrads:
        """The per-example gradients for the upstream gradients ``token_grads`` ``[B, T]``.

        Those the backward built when it ran with these gradients (norms already computed);
        else (no backward reached the kernel, e.g. frozen hidden states) built now, reusing the
        forward's log-sum-exps.
        """
        grads = self.grads
        if grads is not None:
            mine = _token_grads(token_grads, self.labels, self.spec.ignore_index)
            if torch.equal(mine, grads.token_grads):
                return grads
        return self.build(token_grads)


class _Recorded(torch.autograd.Function):
    """Per-token losses; the backward forms the hidden gradient and the example norms."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, record: RecordedLinearCE) -> Tensor:
        h2 = hidden.reshape(-1, hidden.shape[-1])
        batch, steps = record.labels.shape
        mode = "u" if record.keep else None
        if record.keep is None:
            gram_ok = record.route == "ghost" and record.bias is None
            shape = (batch, steps, record.weight.shape[0])
            mode = keeps_logit_grads(shape, record.tiles, h2.device, gram_ok=gram_ok)
        labels = record.labels.reshape(-1)
        if mode == "u" and record.auto_route:
            hsize, vocab = h2.shape[1], record.weight.shape[0]
            route = "ghost" if kept_ghost_is_cheaper(steps, hsize, vocab) else "materialised"
            if route != record.route:
                logger.debug("recorded linear cross-entropy: kept logit gradients, %s route", route)
            record.route = route
        if mode is not None:
            tok, lse, record.kept = kept_forward(
                h2,
                record.weight,
                labels,
                record.spec,
                bias=record.bias,
                tiles=record.tiles,
                with_hidden_grad=hidden.requires_grad,
                gram_steps=steps if mode == "gram" else None,
            )
        else:
            tok, lse, _ = _loss_cores.lce_forward(
                h2, record.weight, record.bias, labels, record.spec, record.tiles
            )
        record.lse = lse
        ctx.record = record
        return tok.view(record.labels.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        record: RecordedLinearCE = ctx.record
        grads = record.build(grad)
        hidden_grad = grads.hidden_grad()
        record.grads = grads
        if record.kept is not None:  # u W is not needed again: free it
            record.kept.hidden_grad = None
        return hidden_grad.to(record.hidden.dtype), None


def linear_cross_entropy_recorded(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    logit_scale: float | None = None,
    logit_divisor: float | None = None,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    chunk_size: bool | int = True,
    route: str = "auto",
    keep_logit_grads: bool | None = None,
) -> tuple[Tensor, RecordedLinearCE]:
    """Per-token losses ``[B, T]`` differentiable in ``hidden``; the projection's per-example
    gradients come from the returned record after the backward.

    The book-keeping form of :func:`~opake.kernels.chunked.linear_cross_entropy`
    (``reduction="none"``): ``weight`` and ``bias`` are constants here (pass them detached; one
    that requires grad raises, since its gradient would silently be missing).

    ``keep_logit_grads`` (``None``: automatic) makes the forward keep the fp32 logit gradients
    (``4·B·T·V`` bytes; automatic: when one vocabulary tile spans the vocabulary and they fit
    a quarter of the available memory): the backward and every later use then compute no logit
    again. Otherwise the backward recomputes each logits tile once and forms from it both the
    hidden states' gradient and each example's squared norm
    (``record.example_grads(token_grads)``).

    >>> import torch
    >>> h = torch.randn(2, 3, 4, requires_grad=True)
    >>> w, y = torch.randn(5, 4), torch.tensor([[0, 1, 2], [3, 4, -100]])
    >>> losses, record = linear_cross_entropy_recorded(h, w, y, chunk_size=2)
    >>> losses.sum().backward()
    >>> record.example_grads(torch.ones(2, 3)).sq_norms()[0].shape
    torch.Size([2])
    """
    asked = route
    hidden, weight, labels, bias, spec, tiles, route = _prepare(
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
    for name, value in (("weight", weight), ("bias", bias)):
        if value is not None and value.requires_grad:
            raise ConfigurationError(
                f"linear_cross_entropy_recorded: {name} requires grad, but this loss treats it "
                f"as a constant (its per-example gradients come from the record); pass "
                f"{name}.detach(), or use linear_cross_entropy for an ordinary gradient"
            )
    if keep_logit_grads is not None and not isinstance(keep_logit_grads, bool):
        raise ConfigurationError(
            f"keep_logit_grads={keep_logit_grads!r}: expected True, False or None (automatic)"
        )
    record = RecordedLinearCE(
        hidden.detach(),
        weight,
        labels,
        bias=bias,
        spec=spec,
        tiles=tiles,
        route=route,
        keep=keep_logit_grads,
        auto_route=asked == "auto",
    )
    return apply(_Recorded, hidden, record), record
