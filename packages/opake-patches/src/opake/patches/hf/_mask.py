"""2-D padding masks → 4-D float additive masks that ``vmap`` accepts.

transformers' mask construction (``masking_utils``) branches on the mask's values, which
``vmap`` cannot batch; a 4-D *float additive* mask is passed through untouched by every
attention implementation. A 4-D *bool* mask would be misread by eager attention (added as 0/1),
so the mask built here is always floating point: ``0`` where a query may attend to a key and
``torch.finfo(dtype).min`` where it may not.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any, Literal

from opake.core.errors import ConfigurationError, InputTypeError
from opake.patches._patcher import tag

if TYPE_CHECKING:
    import torch

    from opake.patches._patcher import Patcher

__all__ = ["ATTENTION_KINDS", "additive_attention_mask", "install_mask_conversion"]

#: how queries may attend: to earlier keys only (decoders) or to every key (encoders)
ATTENTION_KINDS: tuple[str, ...] = ("causal", "bidirectional")


def additive_attention_mask(
    attention_mask: torch.Tensor,
    *,
    dtype: torch.dtype,
    causal: bool,
) -> torch.Tensor:
    """Turn a ``(B, T)`` 0/1 padding mask into a ``(B, 1, T, T)`` float additive mask.

    Key ``j`` is visible to query ``i`` when ``attention_mask[b, j]`` is non-zero and, for a
    causal model, ``j <= i``. Visible entries are ``0``, the others ``torch.finfo(dtype).min``
    (never ``-inf``: a query whose keys are all padding gets uniform weights, not NaN). Only
    elementwise operations are used, so it works under ``vmap`` (with ``B = 1`` inside).

    Example:
        >>> import torch
        >>> m = additive_attention_mask(torch.tensor([[0, 1, 1]]), dtype=torch.float32, causal=True)
        >>> (m == 0).int()[0, 0].tolist()
        [[0, 0, 0], [0, 1, 0], [0, 1, 1]]
        >>> m.dtype, m.shape
        (torch.float32, torch.Size([1, 1, 3, 3]))
    """
    import torch

    if not isinstance(attention_mask, torch.Tensor):
        raise InputTypeError(
            f"attention_mask must be a tensor, got {type(attention_mask).__name__}."
        )
    if attention_mask.dim() != 2:
        raise ConfigurationError(
            f"attention_mask of shape {tuple(attention_mask.shape)}: expected (batch, "
            "sequence); 4-D masks are already in the form attention uses."
        )
    if not (dtype.is_floating_point):
        raise InputTypeError(f"dtype must be a floating-point dtype, got {dtype}.")
    keys = attention_mask.to(torch.bool)[:, None, None, :]  # (B, 1, 1, T)
    t = attention_mask.shape[-1]
    if causal:
        order = torch.arange(t, device=attention_mask.device)
        visible = keys & (order[None, None, None, :] <= order[None, None, :, None])
    else:
        visible = keys.expand(-1, -1, t, -1)
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    low = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=attention_mask.device)
    return torch.where(visible, zero, low)


def _model_dtype(model: Any) -> torch.dtype:
    import torch

    for p in model.parameters():
        if p.is_floating_point():
            dtype: torch.dtype = p.dtype
            return dtype
    return torch.get_default_dtype()


def install_mask_conversion(
    model: Any, attention: Literal["causal", "bidirectional"], patcher: Patcher
) -> None:
    """Wrap ``model.forward`` (this instance only) so 2-D ``attention_mask`` becomes 4-D float.

    4-D masks and ``None`` pass through unchanged; everything else is forwarded as given.
    """
    if attention not in ATTENTION_KINDS:
        raise ConfigurationError(
            f"attention={attention!r}: expected one of {ATTENTION_KINDS} (how queries attend)."
        )
    inner = model.forward
    try:
        params = list(inspect.signature(inner).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    index = positional.index("attention_mask") if "attention_mask" in positional else None
    causal = attention == "causal"

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> object:
        mask = kwargs.get("attention_mask")
        if mask is not None:
            if getattr(mask, "dim", lambda: 0)() == 2:
                dtype = _model_dtype(model)
                kwargs["attention_mask"] = additive_attention_mask(mask, dtype=dtype, causal=causal)
        elif index is not None and len(args) > index and args[index] is not None:
            mask = args[index]
            if getattr(mask, "dim", lambda: 0)() == 2:
                new = list(args)
                dtype = _model_dtype(model)
                new[index] = additive_attention_mask(mask, dtype=dtype, causal=causal)
                args = tuple(new)
        return inner(*args, **kwargs)

    tag(forward, "_opake_stage", "attention_mask")
    patcher.set_attr(model, "forward", forward)
