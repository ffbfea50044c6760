"""The cross-entropy (on logits) Function pair."""

# ruff: noqa: PLR0917  (autograd.Function.apply and Triton launches take positional arguments only)

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from opake.functional import cached_signature
from opake.kernels._args import LossSpec
from opake.kernels._autograd._common import (
    Tensor,
    apply,
)
from opake.kernels._autograd._common import (
    fold as _fold,
)
from opake.kernels._autograd._common import (
    front as _front,
)
from opake.kernels._autograd._common import (
    no_double_backward as _no_double_backward,
)
from opake.kernels._math import check_label_values, reduce_tokens, token_grad

__all__ = ["make_ce_function"]


def make_ce_function(
    name: str,
    forward_core: Callable[[Tensor, Tensor, LossSpec, Any], tuple[Tensor, Tensor]],
    backward_core: Callable[[Tensor, Tensor, Tensor, Tensor, LossSpec, Any], Tensor],
) -> type[torch.autograd.Function]:
    """Cross-entropy on logits: ``apply(logits (N,V), labels (N,), spec, opts) -> (loss, lse)``."""

    @cached_signature
    class _Backward(torch.autograd.Function):
        @staticmethod
        def forward(
            logits: Tensor, labels: Tensor, lse: Tensor, tgrad: Tensor, spec: LossSpec, opts: Any
        ) -> Tensor:
            return backward_core(logits, labels, lse, tgrad, spec, opts)

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            return None

        backward = staticmethod(_no_double_backward)

        @staticmethod
        def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
            return _ce_backward_vmap(_Backward, info, in_dims, *args)

    @cached_signature
    class _Forward(torch.autograd.Function):
        @staticmethod
        def forward(
            logits: Tensor, labels: Tensor, spec: LossSpec, opts: Any
        ) -> tuple[Tensor, Tensor]:
            check_label_values(labels, logits.shape[-1], spec.ignore_index)
            tok, lse = forward_core(logits, labels, spec, opts)
            return reduce_tokens(tok, labels, spec), lse

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            logits, labels, spec, opts = inputs
            ctx.mark_non_differentiable(output[1])
            ctx.save_for_backward(logits, labels, output[1])
            ctx.spec = spec
            ctx.opts = opts

        @staticmethod
        def backward(ctx: Any, grad_out: Tensor, _grad_lse: Tensor | None) -> tuple[Any, ...]:
            logits, labels, lse = ctx.saved_tensors
            tgrad = token_grad(grad_out, labels, ctx.spec)
            return (
                apply(_Backward, logits, labels, lse, tgrad, ctx.spec, ctx.opts),
                None,
                None,
                None,
            )

        @staticmethod
        def vmap(
            info: Any,
            in_dims: tuple[Any, ...],
            logits: Tensor,
            labels: Tensor,
            spec: LossSpec,
            opts: Any,
        ) -> tuple[Any, Any]:
            b = info.batch_size
            xd, yd = in_dims[:2]
            n = _front(labels, yd, b).shape[1]
            loss, lse = apply(
                _Forward, _fold(logits, xd, b), _fold(labels, yd, b), spec.folded(b), opts
            )
            return (loss.reshape(b, -1), lse.reshape(b, n)), (0, 0)

    _Forward.__name__ = _Forward.__qualname__ = f"{name}CrossEntropy"
    _Backward.__name__ = _Backward.__qualname__ = f"{name}CrossEntropyBackward"
    return _Forward


def _ce_backward_vmap(
    cls: Any,
    info: Any,
    in_dims: tuple[Any, ...],
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
    tgrad: Tensor,
    spec: LossSpec,
    opts: Any,
) -> tuple[Any, Any]:
    """The backward Function's vmap rule: the examples folded into the rows."""
    b = info.batch_size
    xd, yd, ld, gd = in_dims[:4]
    shape = _front(logits, xd, b).shape
    out = cls.apply(
        _fold(logits, xd, b),
        _fold(labels, yd, b),
        _fold(lse, ld, b),
        _fold(tgrad, gd, b),
        spec,
        opts,
    )
    return out.reshape(shape), 0
