"""vmap-native autograd scaffolding shared by the ``chunked`` and ``triton`` backends.

Each op is two ``torch.autograd.Function`` classes built around a backend's *cores* (functions
that only ever see plain tensors):

* the forward Function calls the forward core and saves what the backward needs
  (``setup_context`` style, which ``torch.func`` requires);
* its ``backward`` calls a second Function whose forward is the backward core, so the backward
  of a kernel is itself a single call that ``vmap`` can fold;
* both define an explicit ``vmap`` staticmethod: the vmapped dimension is folded into the token
  (row) dimension when the parameters (``weight``/``bias``) are shared, and the op runs once per
  example when they are batched. Weight and bias gradients are produced per *group* of tokens,
  one group per folded example, so ``vmap(grad(loss, argnums=weight))`` yields each example's own
  weight gradient, never a sum across examples.

Kernels therefore never receive a ``BatchedTensor`` (Triton cannot read one), and memory stays
bounded by the backend's tiling whatever the vmap batch size.
"""

# ruff: noqa: PLR0917  (autograd.Function.apply and Triton launches take positional arguments only)

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from opake.core.errors import OperationError
from opake.kernels._args import LossSpec
from opake.kernels._math import check_label_values, reduce_tokens, token_grad

__all__ = [
    "LCEBackwardCore",
    "LCEForwardCore",
    "make_ce_function",
    "make_lce_function",
    "make_pointwise_function",
    "make_rms_norm_function",
    "make_rope_function",
]

Tensor = torch.Tensor
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


def _no_double_backward(ctx: Any, *grad_outputs: Any) -> Any:
    raise OperationError(
        "opake kernels are first-order: the backward of a fused kernel cannot be differentiated "
        "again (no Hessians or double backward through it). Use backend='torch' for that."
    )


def _fold(t: Tensor, dim: int | None, batch: int) -> Tensor:
    """Move the vmapped *dim* to the front (expanding if unbatched) and merge it with dim 1."""
    t = t.unsqueeze(0).expand(batch, *t.shape) if dim is None else t.movedim(dim, 0)
    return t.reshape(batch * t.shape[1], *t.shape[2:])


def _front(t: Tensor, dim: int | None, batch: int) -> Tensor:
    """Move the vmapped *dim* to the front, expanding an unbatched tensor."""
    return t.unsqueeze(0).expand(batch, *t.shape) if dim is None else t.movedim(dim, 0)


def _pick(t: Any, dim: int | None, i: int) -> Any:
    return t.select(dim, i) if isinstance(t, torch.Tensor) and isinstance(dim, int) else t


def _per_example(
    fn: Callable[..., Any], batch: int, args: Sequence[Any], in_dims: Sequence[int | None]
) -> tuple[Any, Any]:
    """Run *fn* once per example and stack the results along dim 0 (``None`` stays ``None``)."""
    results = [
        fn(*[_pick(a, d, i) for a, d in zip(args, in_dims, strict=False)]) for i in range(batch)
    ]
    if isinstance(results[0], tuple):
        outs = tuple(
            None if results[0][k] is None else torch.stack([r[k] for r in results])
            for k in range(len(results[0]))
        )
        return outs, tuple(None if o is None else 0 for o in outs)
    return torch.stack(results), 0


def _squeeze_group(t: Tensor | None) -> Tensor | None:
    return None if t is None else t[0]


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
        def vmap(
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
            b = info.batch_size
            hd, wd, bd, yd, ld, gd = in_dims[:6]
            args = (hidden, weight, bias, labels, lse, tgrad, spec, opts, needs, groups)
            if wd is not None or bd is not None:  # per-example parameters: one call each
                return _per_example(_Backward.apply, b, args, in_dims)
            n = _front(labels, yd, b).shape[1]
            gh, gw, gb = _Backward.apply(
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
                gh, gw, gb = _ScaleStash.apply(
                    grad_out, *stash, needs, ctx.spec.n_seg, hidden, weight, bias
                )
            else:
                tgrad = token_grad(grad_out, labels, ctx.spec)
                gh, gw, gb = _Backward.apply(
                    hidden, weight, bias, labels, lse, tgrad, ctx.spec, ctx.opts, needs, 1
                )
                gw, gb = _squeeze_group(gw), _squeeze_group(gb)
            return (
                None if gh is None else gh.to(hidden.dtype),
                None if gw is None else gw.to(weight.dtype),
                None if gb is None or bias is None else gb.to(bias.dtype),
                *none4,
            )

        @staticmethod
        def vmap(
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
            b = info.batch_size
            hd, wd, bd, yd = in_dims[:4]
            if wd is not None or bd is not None:
                return _per_example(
                    _Forward.apply, b, (hidden, weight, bias, labels, spec, opts, pre), in_dims
                )
            n = labels.shape[0] if yd is None else labels.movedim(yd, 0).shape[1]
            k = spec.n_seg
            loss, lse, gh, gw, gb = _Forward.apply(
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

    _Forward.__name__ = _Forward.__qualname__ = f"{name}LinearCrossEntropy"
    _Backward.__name__ = _Backward.__qualname__ = f"{name}LinearCrossEntropyBackward"
    return _Forward


def make_ce_function(
    name: str,
    forward_core: Callable[[Tensor, Tensor, LossSpec, Any], tuple[Tensor, Tensor]],
    backward_core: Callable[[Tensor, Tensor, Tensor, Tensor, LossSpec, Any], Tensor],
) -> type[torch.autograd.Function]:
    """Cross-entropy on logits: ``apply(logits (N,V), labels (N,), spec, opts) -> (loss, lse)``."""

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
        def vmap(
            info: Any,
            in_dims: tuple[Any, ...],
            logits: Tensor,
            labels: Tensor,
            lse: Tensor,
            tgrad: Tensor,
            spec: LossSpec,
            opts: Any,
        ) -> tuple[Any, Any]:
            b = info.batch_size
            xd, yd, ld, gd = in_dims[:4]
            shape = _front(logits, xd, b).shape
            out = _Backward.apply(
                _fold(logits, xd, b),
                _fold(labels, yd, b),
                _fold(lse, ld, b),
                _fold(tgrad, gd, b),
                spec,
                opts,
            )
            return out.reshape(shape), 0

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
            return _Backward.apply(logits, labels, lse, tgrad, ctx.spec, ctx.opts), None, None, None

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
            loss, lse = _Forward.apply(
                _fold(logits, xd, b), _fold(labels, yd, b), spec.folded(b), opts
            )
            return (loss.reshape(b, -1), lse.reshape(b, n)), (0, 0)

    _Forward.__name__ = _Forward.__qualname__ = f"{name}CrossEntropy"
    _Backward.__name__ = _Backward.__qualname__ = f"{name}CrossEntropyBackward"
    return _Forward


def make_rms_norm_function(
    name: str,
    forward_core: Callable[[Tensor, Tensor | None, float, float], tuple[Tensor, Tensor]],
    backward_core: Callable[..., tuple[Tensor | None, Tensor | None]],
) -> type[torch.autograd.Function]:
    """RMSNorm: ``apply(x (R,D), weight (D,)|None, eps, offset) -> (y, rstd)``.

    The backward core is ``(x, weight, rstd, grad_y, offset, needs, groups) -> (gx, gw (G,D))``.
    """

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
        def vmap(
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
            b = info.batch_size
            xd, wd, rd, gd = in_dims[:4]
            args = (x, weight, rstd, gy, offset, needs, groups)
            if wd is not None:
                return _per_example(_Backward.apply, b, args, in_dims)
            n = _front(x, xd, b).shape[1]
            gx, gw = _Backward.apply(
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
            gx, gw = _Backward.apply(x, weight, rstd, gy, ctx.offset, needs, 1)
            return gx, _squeeze_group(gw), None, None

        @staticmethod
        def vmap(
            info: Any,
            in_dims: tuple[Any, ...],
            x: Tensor,
            weight: Tensor | None,
            eps: float,
            offset: float,
        ) -> tuple[Any, Any]:
            b = info.batch_size
            xd, wd = in_dims[:2]
            if wd is not None:
                return _per_example(_Forward.apply, b, (x, weight, eps, offset), in_dims)
            n = _front(x, xd, b).shape[1]
            y, rstd = _Forward.apply(_fold(x, xd, b), weight, eps, offset)
            return (y.reshape(b, n, y.shape[-1]), rstd.reshape(b, n)), (0, 0)

    _Forward.__name__ = _Forward.__qualname__ = f"{name}RMSNorm"
    _Backward.__name__ = _Backward.__qualname__ = f"{name}RMSNormBackward"
    return _Forward


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
            return _Backward.apply(gate, up, g, kind), (0, 0)

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
            ga, gu = _Backward.apply(gate, up, g, ctx.kind)
            return ga, gu, None

        @staticmethod
        def vmap(
            info: Any, in_dims: tuple[Any, ...], gate: Tensor, up: Tensor, kind: str
        ) -> tuple[Any, Any]:
            gate, up = _same_front(info.batch_size, in_dims[:2], (gate, up))
            return _Forward.apply(gate, up, kind), 0

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
            return _Backward.apply(g, cos, sin), 0

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
            gx = _Backward.apply(g, cos, sin) if ctx.needs_input_grad[0] else None
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
            return _Forward.apply(x, cos, sin), 0

    _Forward.__name__ = _Forward.__qualname__ = f"{name}Rope"
    _Backward.__name__ = _Backward.__qualname__ = f"{name}RopeBackward"
    return _Forward
