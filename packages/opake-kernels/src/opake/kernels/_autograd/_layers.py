"""The Function pairs of the layer ops: RMSNorm, gated activations, rotary embedding."""

# ruff: noqa: PLR0917  (autograd.Function.apply and Triton launches take positional arguments only)

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from opake.functional import cached_signature
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
from opake.kernels._autograd._common import (
    per_example as _per_example,
)
from opake.kernels._autograd._common import (
    squeeze_group as _squeeze_group,
)

__all__ = ["make_pointwise_function", "make_rms_norm_function", "make_rope_function"]


def make_rms_norm_function(
    name: str,
    forward_core: Callable[[Tensor, Tensor | None, float, float], tuple[Tensor, Tensor]],
    backward_core: Callable[..., tuple[Tensor | None, Tensor | None]],
) -> type[torch.autograd.Function]:
    """RMSNorm: ``apply(x (R,D), weight (D,)|None, eps, offset) -> (y, rstd)``.

    The backward core is ``(x, weight, rstd, grad_y, offset, needs, groups) -> (gx, gw (G,D))``.
    """

    @cached_signature
    class _Backward(torch.autograd.Function):
        @staticmethod
        def forward(
            x: Tensor,
            weight: Tensor | None,
            rstd: Tensor,
            gy: Tensor,
            offset: float,
            needs: tuple[bool, bool],
            groups: int,
        ) -> tuple[Tensor | None, Tensor | None]:
            return backward_core(x, weight, rstd, gy, offset, needs, groups)

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            return None

        backward = staticmethod(_no_double_backward)

        @staticmethod
        def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
            return _rms_backward_vmap(_Backward, info, in_dims, *args)

    @cached_signature
    class _Forward(torch.autograd.Function):
        @staticmethod
        def forward(
            x: Tensor, weight: Tensor | None, eps: float, offset: float
        ) -> tuple[Tensor, Tensor]:
            return forward_core(x, weight, eps, offset)

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            x, weight, _eps, offset = inputs
            ctx.mark_non_differentiable(output[1])
            ctx.save_for_backward(x, weight, output[1])
            ctx.offset = offset

        @staticmethod
        def backward(ctx: Any, gy: Tensor, _grad_rstd: Tensor | None) -> tuple[Any, ...]:
            x, weight, rstd = ctx.saved_tensors
            needs = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]))
            if not any(needs):
                return None, None, None, None
            gx, gw = apply(_Backward, x, weight, rstd, gy, ctx.offset, needs, 1)
            return gx, _squeeze_group(gw), None, None

        @staticmethod
        def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
            return _rms_forward_vmap(_Forward, info, in_dims, *args)

    _Forward.__name__ = _Forward.__qualname__ = f"{name}RMSNorm"
    _Backward.__name__ = _Backward.__qualname__ = f"{name}RMSNormBackward"
    return _Forward


def _rms_forward_vmap(
    cls: Any,
    info: Any,
    in_dims: tuple[Any, ...],
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    offset: float,
) -> tuple[Any, Any]:
    """The forward Function's vmap rule: rows folded (shared weight), or one call per example."""
    b = info.batch_size
    xd, wd = in_dims[:2]
    if wd is not None:
        return _per_example(cls.apply, b, (x, weight, eps, offset), in_dims)
    n = _front(x, xd, b).shape[1]
    y, rstd = cls.apply(_fold(x, xd, b), weight, eps, offset)
    return (y.reshape(b, n, y.shape[-1]), rstd.reshape(b, n)), (0, 0)


def _rms_backward_vmap(
    cls: Any,
    info: Any,
    in_dims: tuple[Any, ...],
    x: Tensor,
    weight: Tensor | None,
    rstd: Tensor,
    gy: Tensor,
    offset: float,
    needs: tuple[bool, bool],
    groups: int,
) -> tuple[Any, Any]:
    """The backward Function's vmap rule: rows folded (shared weight), or one call per example."""
    b = info.batch_size
    xd, wd, rd, gd = in_dims[:4]
    args = (x, weight, rstd, gy, offset, needs, groups)
    if wd is not None:
        return _per_example(cls.apply, b, args, in_dims)
    n = _front(x, xd, b).shape[1]
    gx, gw = cls.apply(
        _fold(x, xd, b),
        weight,
        _fold(rstd, rd, b),
        _fold(gy, gd, b),
        offset,
        needs,
        groups * b,
    )
    out = (
        None if gx is None else gx.reshape(b, n, gx.shape[-1]),
        None if gw is None else gw.reshape(b, groups, gw.shape[-1]),
    )
    return out, tuple(None if o is None else 0 for o in out)


def make_pointwise_function(
    name: str,
    forward_core: Callable[[Tensor, Tensor, str], Tensor],
    backward_core: Callable[[Tensor, Tensor, Tensor, str], tuple[Tensor, Tensor]],
) -> type[torch.autograd.Function]:
    """Gated activation ``act(gate) * up``: ``apply(gate, up, kind) -> out`` (same shapes).

    ``kind`` is ``"silu"``, ``"gelu"`` or ``"gelu_tanh"``; the backward core returns
    ``(grad_gate, grad_up)`` and recomputes the activation instead of saving it.
    """

    def _same_front(
        b: int, in_dims: Sequence[int | None], tensors: Sequence[Tensor]
    ) -> list[Tensor]:
        return [_front(t, d, b) for t, d in zip(tensors, in_dims, strict=False)]

    @cached_signature
    class _Backward(torch.autograd.Function):
        @staticmethod
        def forward(gate: Tensor, up: Tensor, g: Tensor, kind: str) -> tuple[Tensor, Tensor]:
            return backward_core(gate, up, g, kind)

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            return None

        backward = staticmethod(_no_double_backward)

        @staticmethod
        def vmap(
            info: Any, in_dims: tuple[Any, ...], gate: Tensor, up: Tensor, g: Tensor, kind: str
        ) -> tuple[Any, Any]:
            gate, up, g = _same_front(info.batch_size, in_dims[:3], (gate, up, g))
            return apply(_Backward, gate, up, g, kind), (0, 0)

    @cached_signature
    class _Forward(torch.autograd.Function):
        @staticmethod
        def forward(gate: Tensor, up: Tensor, kind: str) -> Tensor:
            return forward_core(gate, up, kind)

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            gate, up, kind = inputs
            ctx.save_for_backward(gate, up)
            ctx.kind = kind

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:
            gate, up = ctx.saved_tensors
            ga, gu = apply(_Backward, gate, up, g, ctx.kind)
            return ga, gu, None

        @staticmethod
        def vmap(
            info: Any, in_dims: tuple[Any, ...], gate: Tensor, up: Tensor, kind: str
        ) -> tuple[Any, Any]:
            gate, up = _same_front(info.batch_size, in_dims[:2], (gate, up))
            return apply(_Forward, gate, up, kind), 0

    _Forward.__name__ = _Forward.__qualname__ = f"{name}GatedActivation"
    _Backward.__name__ = _Backward.__qualname__ = f"{name}GatedActivationBackward"
    return _Forward


def _rope_align(
    b: int, in_dims: Sequence[int | None], x: Tensor, cos: Tensor, sin: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Give x, cos and sin a leading batch dimension of size *b* (1 for unbatched tables)."""
    xd, cd, sd = in_dims[:3]
    x = _front(x, xd, b)
    nd = x.dim() - 1

    def table(t: Tensor, d: int | None) -> Tensor:
        if d is None:
            return t.reshape(1, *([1] * (nd - t.dim())), *t.shape)
        t = t.movedim(d, 0)
        return t.reshape(t.shape[0], *([1] * (nd - (t.dim() - 1))), *t.shape[1:])

    return x, table(cos, cd), table(sin, sd)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def make_rope_function(
    name: str,
    forward_core: Callable[[Tensor, Tensor, Tensor], Tensor],
    backward_core: Callable[[Tensor, Tensor, Tensor], Tensor],
) -> type[torch.autograd.Function]:
    """Rotary embedding ``x·cos + rotate_half(x)·sin``: ``apply(x, cos, sin) -> out``.

    ``cos``/``sin`` broadcast to ``x``. The backward core maps ``grad_out`` to ``grad_x``; the
    (rarely needed) gradients of ``cos``/``sin`` are reduced with plain tensor ops.
    """

    @cached_signature
    class _Backward(torch.autograd.Function):
        @staticmethod
        def forward(g: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
            return backward_core(g, cos, sin)

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            return None

        backward = staticmethod(_no_double_backward)

        @staticmethod
        def vmap(
            info: Any, in_dims: tuple[Any, ...], g: Tensor, cos: Tensor, sin: Tensor
        ) -> tuple[Any, Any]:
            g, cos, sin = _rope_align(info.batch_size, in_dims, g, cos, sin)
            return apply(_Backward, g, cos, sin), 0

    @cached_signature
    class _Forward(torch.autograd.Function):
        @staticmethod
        def forward(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
            return forward_core(x, cos, sin)

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            x, cos, sin = inputs
            ctx.save_for_backward(x, cos, sin)

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:
            x, cos, sin = ctx.saved_tensors
            gx = apply(_Backward, g, cos, sin) if ctx.needs_input_grad[0] else None
            gcos = gsin = None
            if ctx.needs_input_grad[1]:
                gcos = (g.float() * x.float()).sum_to_size(cos.shape).to(cos.dtype)
            if ctx.needs_input_grad[2]:
                gsin = (g.float() * _rotate_half(x.float())).sum_to_size(sin.shape).to(sin.dtype)
            return gx, gcos, gsin

        @staticmethod
        def vmap(
            info: Any, in_dims: tuple[Any, ...], x: Tensor, cos: Tensor, sin: Tensor
        ) -> tuple[Any, Any]:
            x, cos, sin = _rope_align(info.batch_size, in_dims, x, cos, sin)
            return apply(_Forward, x, cos, sin), 0

    _Forward.__name__ = _Forward.__qualname__ = f"{name}Rope"
    _Backward.__name__ = _Backward.__qualname__ = f"{name}RopeBackward"
    return _Forward
