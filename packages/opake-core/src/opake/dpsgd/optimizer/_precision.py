"""Mixed precision for per-example losses: low-precision compute, fp32 gradients and clipping.

Implementation of :func:`opake.dpsgd.optimizer.autocast_loss`.

bf16: the loss runs under ``torch.autocast``; with fp32 parameters every per-example gradient
comes back in fp32 (autocast's casts are differentiated), so clipping, the sum and the noise
stay fp32.

fp16: its narrow exponent range makes small backward values underflow, so the backward pass is
*scaled*: the loss is returned unchanged but its gradient seed is ``S`` (a power of two), and
each parameter's gradient is multiplied by ``1/S`` in fp32 at the parameter itself, inside the
differentiated function. The per-example gradients that reach clipping are therefore already
unscaled: the norms, the clip and the sensitivity are exactly those of the unscaled loss (with a
power of two the unscale is exact, bit for bit). Overflow is a per-example event: an example
whose scaled backward overflows gets a non-finite gradient, which clipping treats like any
other non-finite example (it contributes zero, counted in the clipping aux). The logical step is
never skipped, because skipping on a data-dependent overflow would reveal it; the step is noised
and accounted as usual. The scale is static for the same reason: growing or shrinking it from
overflow counts would make a training hyperparameter depend on private data.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from opake.core.errors import ConfigurationError, InputTypeError
from opake.functional._autograd import cached_signature

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_FP16_LOSS_SCALE", "autocast_loss"]

#: static loss scale used for fp16 when none is given
DEFAULT_FP16_LOSS_SCALE = 2.0**10


class _GradScale(Protocol):
    """The ``GradScale`` Function class as used here (torch leaves ``Function.apply`` untyped)."""

    def apply(self, x: torch.Tensor, factor: float, /) -> torch.Tensor: ...


_GRAD_SCALE: _GradScale | None = None


def _grad_scale_function() -> _GradScale:
    """``apply(x, factor)``: identity forward, gradient multiplied by ``factor`` (vmap-safe)."""
    global _GRAD_SCALE
    if _GRAD_SCALE is None:
        import torch

        @cached_signature
        class GradScale(torch.autograd.Function):
            generate_vmap_rule = True

            @staticmethod
            def forward(x: torch.Tensor, factor: float) -> torch.Tensor:
                return x.view_as(x)

            @staticmethod
            def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
                ctx.factor = inputs[1]

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
                return grad * ctx.factor, None

        _GRAD_SCALE = GradScale
    return _GRAD_SCALE


def _check_scale(loss_scale: object) -> float:
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, int | float):
        raise InputTypeError(
            f"loss_scale={loss_scale!r} ({type(loss_scale).__name__}): expected a power of two "
            "such as 1024.0"
        )
    scale = float(loss_scale)
    if not math.isfinite(scale) or scale <= 0.0 or math.frexp(scale)[0] != 0.5:
        raise ConfigurationError(
            f"loss_scale={loss_scale!r}: expected a positive power of two (e.g. 2.0**10), so "
            "that unscaling is exact"
        )
    return scale


def _device_type(tree: Any) -> str:
    import torch
    from torch.utils._pytree import tree_leaves

    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            return leaf.device.type
    raise InputTypeError(
        "autocast_loss: the differentiated argument holds no tensor; pass device_type= "
        "explicitly or check argnums"
    )


def autocast_loss(
    loss_fn: Callable[..., Any],
    dtype: torch.dtype | str = "bfloat16",
    *,
    loss_scale: float | None = None,
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    device_type: str | None = None,
) -> Callable[..., Any]:
    """Wrap a per-example ``loss_fn`` for mixed-precision compute with fp32 gradients.

    The returned function has ``loss_fn``'s signature; pass it to ``clipped_grad`` in place of
    ``loss_fn``. It runs ``loss_fn`` under ``torch.autocast(device_type, dtype)`` and returns the
    loss as fp32. Keep the trainable parameters in fp32 (they are cast per op by autocast and get
    fp32 gradients); the clipping, sum and noise then run in fp32.

    Args:
        loss_fn: the per-example loss, as given to ``clipped_grad``.
        dtype: ``torch.bfloat16`` / ``"bfloat16"`` or ``torch.float16`` / ``"float16"``.
        loss_scale: static power-of-two scale of the backward pass; the parameter gradients are
            unscaled in fp32 *before* they leave the function, i.e. before any norm or clip.
            Default: none for bf16, :data:`DEFAULT_FP16_LOSS_SCALE` for fp16.
        argnums: the argument(s) holding the differentiated parameters (``clipped_grad``'s
            ``argnums``); with a loss scale they must be fp32 (or wider).
        has_aux: ``loss_fn`` returns ``(loss, aux)``.
        device_type: autocast device type; default: that of the first differentiated tensor.

    Example:
        >>> import torch
        >>> from torch.func import grad
        >>> from opake.dpsgd.optimizer import autocast_loss
        >>> def loss_fn(w, x):
        ...     return (x @ w).square().mean()
        >>> w, x = torch.ones(4), torch.full((4,), 0.5)
        >>> g = grad(autocast_loss(loss_fn, torch.float16, loss_scale=2.0**8))(w, x)
        >>> g.dtype, g
        (torch.float32, tensor([2., 2., 2., 2.]))
    """
    import torch
    from torch.utils._pytree import tree_map

    if not callable(loss_fn):
        raise InputTypeError(f"loss_fn={type(loss_fn).__name__}: expected a callable")
    names = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
             "bf16": torch.bfloat16, "half": torch.float16}  # fmt: skip
    compute = names.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if compute not in (torch.bfloat16, torch.float16):
        raise ConfigurationError(
            f"dtype={dtype!r}: expected torch.bfloat16 or torch.float16 (fp32 needs no wrapper)"
        )
    if loss_scale is None:
        scale = DEFAULT_FP16_LOSS_SCALE if compute == torch.float16 else 1.0
    else:
        scale = _check_scale(loss_scale)
    positions = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not positions or not all(
        isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in positions
    ):
        raise InputTypeError(f"argnums={argnums!r}: expected an int ≥ 0 or a tuple of them")
    if not isinstance(has_aux, bool):
        raise InputTypeError(f"has_aux={has_aux!r}: expected True or False")
    scaler = _grad_scale_function() if scale != 1.0 else None
    inv_scale = 1.0 / scale

    def unscale_at_leaf(leaf: object) -> object:
        assert scaler is not None  # only mapped when a scale is set
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if leaf.is_floating_point() and torch.finfo(leaf.dtype).bits < 32:
            raise ConfigurationError(
                f"autocast_loss with loss_scale: a differentiated tensor is {leaf.dtype}; keep "
                "trainable parameters in fp32 (autocast computes in low precision) so the "
                "gradient is unscaled in fp32 before clipping"
            )
        return scaler.apply(leaf, inv_scale)

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, object]:
        if max(positions) >= len(args):
            raise InputTypeError(
                f"autocast_loss(argnums={argnums!r}) but the loss got {len(args)} positional "
                "argument(s)"
            )
        diff = [args[i] for i in positions]
        kind = device_type or _device_type(diff)
        if scaler is not None:
            args = tuple(
                tree_map(unscale_at_leaf, a) if i in positions else a for i, a in enumerate(args)
            )
        with torch.autocast(kind, dtype=compute):
            out = loss_fn(*args, **kwargs)
        loss, aux = out if has_aux else (out, None)
        if not isinstance(loss, torch.Tensor):
            raise InputTypeError(
                f"loss_fn returned {type(loss).__name__}; expected a scalar tensor"
                + ("" if has_aux else " (pass has_aux=True if it returns (loss, aux))")
            )
        loss = loss.float()
        if scaler is not None:
            loss = scaler.apply(loss, scale)
        return (loss, aux) if has_aux else loss

    # __wrapped__ and __doc__ only (not functools.wraps: the name stays "wrapped")
    functools.update_wrapper(wrapped, loss_fn, assigned=("__doc__",), updated=())
    return wrapped
