"""Sliding-window attention masks: the family-specific layer under opake-patches' conversion.

The dispatcher turns a 2-D padding mask into one 4-D float additive mask
(:func:`opake.patches.hf.install_mask_conversion`), and transformers uses a 4-D mask as given
for *every* layer — so on a family with sliding-window layers the window would silently widen
to the whole sequence. The family therefore wraps the *backbone's* forward (which both the
logits path and the loss-only path call) and restricts a 4-D float mask to the window before
the layers see it:

* one windowed mask where every layer slides (Mistral, Phi-3), or
* a dict ``{"full_attention": mask, "sliding_attention": windowed}`` for backbones that pick a
  mask per ``config.layer_types`` entry (Qwen 2/3, Gemma 2).

transformers' window rule: key ``k`` is visible to query ``q`` when ``q - window < k``. Only
elementwise operations are used, so this runs under ``vmap``. ``None``, 2-D and non-float
masks pass through (transformers builds its own windowed masks from those).
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

    from opake.models._spec import Attention
    from opake.patches import Patcher

__all__ = ["install_window_masks", "restrict_to_window", "window_of"]

_KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")


def restrict_to_window(mask: torch.Tensor, window: int) -> torch.Tensor:
    """Mask out keys ``window`` or more positions before each query in a 4-D additive mask.

    >>> import torch
    >>> from opake.patches.hf import additive_attention_mask
    >>> causal = additive_attention_mask(torch.ones(1, 4), dtype=torch.float32, causal=True)
    >>> (restrict_to_window(causal, 2) == 0).int()[0, 0].tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    """
    import torch

    queries, keys = mask.shape[-2], mask.shape[-1]
    q = torch.arange(queries, device=mask.device)[:, None] + (keys - queries)
    k = torch.arange(keys, device=mask.device)[None, :]
    return torch.where(q - k < window, mask, torch.finfo(mask.dtype).min)


def window_of(config: Any, attention: Attention) -> tuple[int | None, bool]:
    """``(window, per_layer_type)`` for this config; ``(None, False)`` when nothing slides."""
    if attention.sliding_window is None:
        return None, False
    window = getattr(config, attention.sliding_window, None)
    if window is None:
        return None, False
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigurationError(
            f"config.{attention.sliding_window}={window!r}: expected a positive window size."
        )
    if not attention.layer_types:
        return window, False
    types = _layer_types(config, attention)
    if "sliding_attention" not in types:
        return None, False
    return window, True


def _layer_types(config: Any, attention: Attention) -> tuple[str, ...]:
    types = tuple(getattr(config, "layer_types", None) or ())
    known = _KNOWN_LAYER_TYPES if attention.linear else _KNOWN_LAYER_TYPES[:2]
    unknown = sorted(set(types) - set(known))
    if unknown:
        raise ConfigurationError(
            f"config.layer_types has {unknown}: the adapter knows {known} only and "
            "will not guess their masks. Patch with compat=False or update the adapter."
        )
    return types


def _linear_layers(config: Any, attention: Attention) -> bool:
    """Whether some layer of this instance is a linear-attention layer (2-D padding mask)."""
    return attention.linear is not None and "linear_attention" in _layer_types(config, attention)


def install_window_masks(
    backbone: Any, config: Any, attention: Attention, patcher: Patcher
) -> int | None:
    """Wrap ``backbone.forward`` (this instance) so 4-D float masks get the sliding window;
    returns the window, or None when no layer of this instance slides.

    Linear-attention layers (``attention.linear``) get the 2-D padding mask (``1`` for real
    tokens) read off the 4-D mask's diagonal: they zero padding states instead of masking
    scores."""
    if attention.sliding_window is not None and getattr(config, attention.sliding_window, None):
        window, per_layer_type = window_of(config, attention)
    else:
        window, per_layer_type = None, False
    linear = _linear_layers(config, attention) if attention.layer_types else False
    if window is None and not linear:
        return None
    inner = backbone.forward
    try:
        names = [
            p.name
            for p in inspect.signature(inner).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):  # pragma: no cover - exotic forwards
        names = []
    index = names.index("attention_mask") if "attention_mask" in names else None

    def convert(mask: Any) -> object:
        """A 4-D float mask windowed (a mask per layer type where they differ); else ``mask``."""
        if getattr(mask, "dim", lambda: 0)() != 4 or not mask.is_floating_point():
            return mask
        # without linear layers something slides: the window is set
        sliding = restrict_to_window(mask, window) if window is not None else None
        if not linear:
            if per_layer_type:
                return {"full_attention": mask, "sliding_attention": sliding}
            return sliding
        from opake.models._moe import padding_of

        steps = mask.shape[-2]
        masks = {
            "full_attention": mask,
            "linear_attention": padding_of(mask, mask.shape[0], steps, mask.device),
        }
        if sliding is not None:
            masks["sliding_attention"] = sliding
        return masks

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> object:
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = convert(kwargs["attention_mask"])
        elif index is not None and len(args) > index:
            args = (*args[:index], convert(args[index]), *args[index + 1 :])
        return inner(*args, **kwargs)

    # mark the wrapper (through vars(): a function's type declares no such attribute)
    vars(forward)["_opake_stage"] = "sliding_window"
    patcher.set_attr(backbone, "forward", forward)
    return window
