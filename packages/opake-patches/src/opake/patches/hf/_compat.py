"""Hugging Face compatibility pieces every family shares (instance-level, reversible).

* :func:`disable_kv_cache` — ``config.use_cache = False``: no cache objects are built inside
  ``vmap`` (an explicit ``use_cache=True`` argument, e.g. from ``generate``, still wins).
* :func:`route_gradient_checkpointing` — HF gradient checkpointing goes through the vmap-safe
  path with ``use_reentrant=False`` forced: existing ``_gradient_checkpointing_func`` partials
  are rebuilt, the "inputs require grad" hooks become no-ops inside transforms, and later calls
  to ``gradient_checkpointing_enable`` / ``activation_checkpointing_enable`` on this instance
  get the same treatment.
* :func:`dropout_status` — which dropout is active in training mode: under ``vmap`` it needs
  ``randomness="different"`` (each example draws its own mask; pass it to ``clipped_grad``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from opake.patches._patcher import tag
from opake.patches.runtime._hf import make_hooks_transform_safe, restore_hooks

if TYPE_CHECKING:
    from opake.patches._patcher import Patcher

__all__ = [
    "checkpoint_non_reentrant",
    "disable_kv_cache",
    "dropout_status",
    "route_gradient_checkpointing",
]

_ENABLE_METHODS = {
    "gradient_checkpointing_enable": "gradient_checkpointing_kwargs",
    "activation_checkpointing_enable": "activation_checkpointing_kwargs",
}

_T = TypeVar("_T")


def disable_kv_cache(model: Any, patcher: Patcher) -> bool:
    """Set ``config.use_cache = False`` on this model's config; True if it changed anything."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "use_cache", False):
        return False
    patcher.set_config(config, "use_cache", False)
    return True


def checkpoint_non_reentrant(function: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, looked up per call.

    Inside ``torch.func`` transforms the (runtime-patched) checkpoint runs Opake's vmap-safe
    region; outside, the stock non-reentrant checkpoint.

    >>> import torch
    >>> x = torch.ones(2, requires_grad=True)
    >>> checkpoint_non_reentrant(torch.sin, x).shape
    torch.Size([2])
    """
    import torch.utils.checkpoint

    kwargs["use_reentrant"] = False
    out: _T = torch.utils.checkpoint.checkpoint(function, *args, **kwargs)  # unannotated there
    return out


def _is_checkpoint(func: object) -> bool:
    import torch.utils.checkpoint as tuc

    stock = getattr(tuc.checkpoint, "__wrapped__", tuc.checkpoint)
    return func is tuc.checkpoint or func is stock or func is checkpoint_non_reentrant


def _vmap_safe(func: Callable[..., Any]) -> Callable[..., Any]:
    """Rebuild an HF ``_gradient_checkpointing_func`` so it is non-reentrant and vmap-safe."""
    if getattr(func, "_opake_routed", False):
        return func
    if isinstance(func, functools.partial):
        target = checkpoint_non_reentrant if _is_checkpoint(func.func) else func.func
        routed = functools.partial(target, *func.args, **{**func.keywords, "use_reentrant": False})
    elif _is_checkpoint(func):
        routed = functools.partial(checkpoint_non_reentrant)
    else:  # an unknown wrapper: force the keyword through it
        routed = functools.partial(func, use_reentrant=False)
    tag(routed, "_opake_routed", True)
    return routed


def _reroute(model: Any, patcher: Patcher) -> int:
    count = 0
    for module in model.modules():
        func = vars(module).get("_gradient_checkpointing_func")
        if func is not None and not getattr(func, "_opake_routed", False):
            patcher.set_attr(module, "_gradient_checkpointing_func", _vmap_safe(func))
            count += 1
    changed = make_hooks_transform_safe(model)
    if changed:
        patcher.push(lambda: restore_hooks(changed))
    return count


def route_gradient_checkpointing(model: Any, patcher: Patcher) -> int:
    """Route this model's HF gradient checkpointing to the vmap-safe, non-reentrant path.

    Returns how many modules already had a checkpointing function (re-routed now); calls to
    ``gradient_checkpointing_enable`` made later on this instance are routed as they happen.
    """
    count = _reroute(model, patcher)
    # transformers >= 5.2x: gradient_checkpointing_enable is a deprecated alias that calls
    # activation_checkpointing_enable, so wrapping the latter covers both (wrapping both would
    # make transformers think the alias is overridden and warn on every call); older versions
    # only have gradient_checkpointing_enable.
    for method in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        stock = getattr(model, method, None)
        if stock is None:
            continue
        if not getattr(stock, "_opake_routed", False):
            patcher.set_attr(
                model, method, _routed_enable(model, stock, _ENABLE_METHODS[method], patcher)
            )
        break
    return count


def _routed_enable(
    model: Any, stock: Callable[..., Any], kwarg: str, patcher: Patcher
) -> Callable[..., Any]:
    @functools.wraps(stock)
    def enable(*args: Any, **kwargs: Any) -> object:
        if args:
            options, args = args[0], args[1:]
        else:
            options = kwargs.pop(kwarg, None)
        options = {**(options or {}), "use_reentrant": False}
        result = stock(*args, **{kwarg: options}, **kwargs)
        _reroute(model, patcher)
        return result

    tag(enable, "_opake_routed", True)
    return enable


def dropout_status(model: Any) -> list[str]:
    """Names of dropout that is active when the model trains (modules with ``p > 0`` and
    ``*dropout*`` config fields above 0), and of a MoE router's jitter (``*jitter*`` fields
    above 0: multiplicative noise drawn while training, random like dropout).

    >>> import torch
    >>> dropout_status(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)))
    ['1 (Dropout, p=0.1)']
    """
    from torch import nn

    found = [
        f"{name or type(m).__name__} ({type(m).__name__}, p={m.p})"
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
    ]
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        for key, value in sorted(config.to_dict().items()):
            if (
                ("dropout" in key or "jitter" in key)
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
                and value > 0
            ):
                found.append(f"config.{key}={value}")
    return found
