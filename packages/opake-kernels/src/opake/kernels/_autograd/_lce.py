"""The linear cross-entropy Function pair (and the scaling of gradients a forward precomputed)."""

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
from opake.kernels._autograd._common import (
    per_example as _per_example,
)
from opake.kernels._autograd._common import (
    squeeze_group as _squeeze_group,
)
from opake.kernels._math import check_label_values, reduce_tokens, token_grad

__all__ = ["LCEBackwardCore", "LCEForwardCore", "make_lce_function"]

Stash = tuple[Tensor | None, Tensor | None, Tensor | None]
#: ``(hidden (N,H), weight (V,H), bias|None, labels (N,), spec, opts, pre)
#: -> (token_loss, lse, stash | None)``; *stash* holds the gradients of (hidden, weight (S,V,H),
#: bias (S,V)) for a unit upstream gradient per segment when *pre* asked for them and the core
#: could compute them in the forward pass (None otherwise: the backward core recomputes).
LCEForwardCore = Callable[
    [Tensor, Tensor, Tensor | None, Tensor, LossSpec, Any, tuple[bool, bool, bool]],
    tuple[Tensor, Tensor, Stash | None],
]
#: ``(..., lse, token_grad, spec, opts, needs, groups) -> (grad_h, grad_w (G,V,H), grad_b (G,V))``
LCEBackwardCore = Callable[..., tuple[Tensor | None, Tensor | None, Tensor | None]]


def _covers(stash: Stash, needs: tuple[bool, bool, bool]) -> bool:
    return all(s is not None for s, n in zip(stash, needs, strict=True) if n)


def _scale_stash(
    g: Tensor,
    gh_s: Tensor | None,
    gw_s: Tensor | None,
    gb_s: Tensor | None,
    needs: tuple[bool, bool, bool],
    n_seg: int,
    batch: int = 1,
) -> Stash:
    """Gradients precomputed for a unit upstream gradient per segment, times the real one *g*.

    ``batch`` folded copies lie end to end (``batch * n_seg`` segments); weight and bias
    gradients are summed over each copy's segments. In place: the stash is private to one
    graph and used once.
    """
    k = batch * n_seg
    g = g.reshape(k).float()
    gh = gw = gb = None
    if needs[0] and gh_s is not None:
        n, h = gh_s.shape
        gh = gh_s.view(k, n // k, h).mul_(g.view(k, 1, 1)).view(n, h)
    if needs[1] and gw_s is not None:
        gw = _sum_segments(gw_s.mul_(g.view(k, 1, 1)), batch, n_seg)
    if needs[2] and gb_s is not None:
        gb = _sum_segments(gb_s.mul_(g.view(k, 1)), batch, n_seg)
    return gh, gw, gb


def _sum_segments(t: Tensor, batch: int, n_seg: int) -> Tensor:
    """``(batch * n_seg, ...)`` -> ``(batch, ...)``; a view (no copy) for one segment each."""
    t = t.view(batch, n_seg, *t.shape[1:])
    return t[:, 0] if n_seg == 1 else t.sum(1)


@cached_signature
class _ScaleStash(torch.autograd.Function):
    """The backward of a forward that precomputed its gradients: scale them (first-order only,
    like every fused backward here: differentiating it again raises). ``inputs`` (the op's
    hidden, weight, bias) are not used; they connect the result to the graph, so that a double
    backward reaches this Function and fails loudly instead of treating gradients as
    constants."""

    @staticmethod
    def forward(
        g: Tensor,
        gh_s: Tensor | None,
        gw_s: Tensor | None,
        gb_s: Tensor | None,
        needs: tuple[bool, bool, bool],
        n_seg: int,
        *inputs: Tensor | None,
    ) -> Stash:
        gh, gw, gb = _scale_stash(g, gh_s, gw_s, gb_s, needs, n_seg)
        return gh, None if gw is None else gw[0], None if gb is None else gb[0]

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        return None

    backward = staticmethod(_no_double_backward)

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[Any, ...],
        g: Tensor,
        gh_s: Tensor | None,
        gw_s: Tensor | None,
        gb_s: Tensor | None,
        needs: tuple[bool, bool, bool],
        n_seg: int,
        *inputs: Tensor | None,
    ) -> tuple[Any, Any]:
        b = info.batch_size
        gd, hd, wd, bd = in_dims[:4]
        gh, gw, gb = _scale_stash(
            _front(g, gd, b).reshape(-1),
            None if gh_s is None else _fold(gh_s, hd, b),
            None if gw_s is None else _fold(gw_s, wd, b),
            None if gb_s is None else _fold(gb_s, bd, b),
            needs,
            n_seg,
            batch=b,
        )
        out = (None if gh is None else gh.reshape(b, -1, gh.shape[-1]), gw, gb)
        return out, tuple(None if o is None else 0 for o in out)


def make_lce_function(
    name: str, forward_core: LCEForwardCore, backward_core: LCEBackwardCore
) -> type[torch.autograd.Function]:
    """Build the linear-cross-entropy Function pair around a backend's cores.

    ``apply(hidden (N,H), weight (V,H), bias, labels (N,), spec, opts) -> (loss, lse)``, where
    ``loss`` is ``(N,)`` for ``spec.reduction == "none"`` and ``(spec.n_seg,)`` otherwise.
    """

    @cached_signature
    class _Backward(torch.autograd.Function):
        @staticmethod
        def forward(
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
            return backward_core(
                hidden, weight, bias, labels, lse, tgrad, spec, opts, needs, groups
            )

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            return None

        backward = staticmethod(_no_double_backward)

        @staticmethod
        def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
            return _lce_backward_vmap(_Backward, info, in_dims, *args)

    @cached_signature
    class _Forward(torch.autograd.Function):
        @staticmethod
        def forward(
            hidden: Tensor,
            weight: Tensor,
            bias: Tensor | None,
            labels: Tensor,
            spec: LossSpec,
            opts: Any,
            pre: tuple[bool, bool, bool],
        ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
            check_label_values(labels, weight.shape[0], spec.ignore_index)
            tok, lse, stash = forward_core(hidden, weight, bias, labels, spec, opts, pre)
            gh, gw, gb = stash if stash is not None else (None, None, None)
            return reduce_tokens(tok, labels, spec), lse, gh, gw, gb

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            hidden, weight, bias, labels, spec, opts, _pre = inputs
            _loss, lse, gh, gw, gb = output
            ctx.mark_non_differentiable(*[t for t in (lse, gh, gw, gb) if t is not None])
            # no zero gradients for the auxiliary outputs (one would be weight-sized)
            ctx.set_materialize_grads(False)
            ctx.save_for_backward(hidden, weight, bias, labels, lse)
            ctx.spec = spec
            ctx.opts = opts
            # kept off save_for_backward: the backward scales it in place, once
            ctx.stash = None if gh is None and gw is None and gb is None else (gh, gw, gb)

        @staticmethod
        def backward(ctx: Any, grad_out: Tensor, *_unused: Any) -> tuple[Any, ...]:
            return _lce_backward(_Backward, ctx, grad_out)

        @staticmethod
        def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
            return _lce_forward_vmap(_Forward, info, in_dims, *args)

    _Forward.__name__ = _Forward.__qualname__ = f"{name}LinearCrossEntropy"
    _Backward.__name__ = _Backward.__qualname__ = f"{name}LinearCrossEntropyBackward"
    return _Forward


def _lce_backward_vmap(
    cls: Any,
    info: Any,
    in_dims: tuple[Any, ...],
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
) -> tuple[Any, Any]:
    """The backward Function's vmap rule: examples folded into the tokens (shared
    parameters), or one call per example (batched parameters)."""
    b = info.batch_size
    hd, wd, bd, yd, ld, gd = in_dims[:6]
    args = (hidden, weight, bias, labels, lse, tgrad, spec, opts, needs, groups)
    if wd is not None or bd is not None:  # per-example parameters: one call each
        return _per_example(cls.apply, b, args, in_dims)
    n = _front(labels, yd, b).shape[1]
    gh, gw, gb = cls.apply(
        _fold(hidden, hd, b),
        weight,
        bias,
        _fold(labels, yd, b),
        _fold(lse, ld, b),
        _fold(tgrad, gd, b),
        spec,
        opts,
        needs,
        groups * b,
    )
    out = (
        None if gh is None else gh.reshape(b, n, gh.shape[-1]),
        None if gw is None else gw.reshape(b, groups, *gw.shape[1:]),
        None if gb is None else gb.reshape(b, groups, gb.shape[-1]),
    )
    return out, tuple(None if o is None else 0 for o in out)


def _lce_backward(backward_cls: Any, ctx: Any, grad_out: Tensor) -> tuple[Any, ...]:
    """The forward Function's backward: scale what the forward precomputed, or recompute."""
    hidden, weight, bias, labels, lse = ctx.saved_tensors
    needs = (
        bool(ctx.needs_input_grad[0]),
        bool(ctx.needs_input_grad[1]),
        bool(ctx.needs_input_grad[2]),
    )
    none4 = (None, None, None, None)
    if grad_out is None or not any(needs):
        return None, None, None, *none4
    stash = ctx.stash
    if stash is not None and _covers(stash, needs):
        ctx.stash = None  # consumed (scaled in place); a second backward recomputes
        gh, gw, gb = apply(
            _ScaleStash, grad_out, *stash, needs, ctx.spec.n_seg, hidden, weight, bias
        )
    else:
        tgrad = token_grad(grad_out, labels, ctx.spec)
        gh, gw, gb = backward_cls.apply(
            hidden, weight, bias, labels, lse, tgrad, ctx.spec, ctx.opts, needs, 1
        )
        gw, gb = _squeeze_group(gw), _squeeze_group(gb)
    return (
        None if gh is None else gh.to(hidden.dtype),
        None if gw is None else gw.to(weight.dtype),
        None if gb is None or bias is None else gb.to(bias.dtype),
        *none4,
    )


def _lce_forward_vmap(
    cls: Any,
    info: Any,
    in_dims: tuple[Any, ...],
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    spec: LossSpec,
    opts: Any,
    pre: tuple[bool, bool, bool],
) -> tuple[Any, Any]:
    """The forward Function's vmap rule (examples folded into the tokens, or one call each)."""
    b = info.batch_size
    hd, wd, bd, yd = in_dims[:4]
    if wd is not None or bd is not None:
        return _per_example(cls.apply, b, (hidden, weight, bias, labels, spec, opts, pre), in_dims)
    n = labels.shape[0] if yd is None else labels.movedim(yd, 0).shape[1]
    k = spec.n_seg
    loss, lse, gh, gw, gb = cls.apply(
        _fold(hidden, hd, b), weight, bias, _fold(labels, yd, b), spec.folded(b), opts, pre
    )
    out = (
        loss.reshape(b, -1),
        lse.reshape(b, n),
        None if gh is None else gh.reshape(b, n, gh.shape[-1]),
        None if gw is None else gw.reshape(b, k, *gw.shape[1:]),
        None if gb is None else gb.reshape(b, k, gb.shape[-1]),
    )
    return out, tuple(None if o is None else 0 for o in out)
