"""Calls that only make sense outside ``torch.func`` transforms.

Some library code inspects the *values* of its inputs to warn about a likely mistake (transformers'
padding check, a hook that reads a tensor): under ``vmap`` each example holds a different value,
so such a question cannot be answered and torch raises ("vmap: ... .item()").
:func:`outside_transforms` wraps such a callable so that it is skipped (returns ``None``) inside
any ``torch.func`` transform and runs unchanged outside every transform. Only for callables
whose result nothing depends on (warnings, bookkeeping hooks that return ``None``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["in_transform", "outside_transforms"]

#: set on every wrapper :func:`outside_transforms` returns (so wrapping twice is a no-op)
MARK = "_opake_outside_transforms"

P = ParamSpec("P")
R = TypeVar("R")


def in_transform() -> bool:
    """Whether the caller runs inside a ``torch.func`` transform (``vmap``, ``grad``, ...).

    >>> import torch
    >>> in_transform(), bool(torch.func.vmap(lambda x: x + in_transform())(torch.zeros(1)))
    (False, True)
    """
    import torch

    return torch._C._functorch.maybe_current_level() is not None


def outside_transforms(fn: Callable[P, R]) -> Callable[P, R | None]:
    """``fn`` skipped inside ``torch.func`` transforms (it returns ``None`` there) and called
    unchanged outside them; the stock callable stays reachable as ``__wrapped__``.

    >>> import torch
    >>> @outside_transforms
    ... def has_zero(x):
    ...     return bool(0 in x)
    >>> has_zero(torch.tensor([0, 1])), outside_transforms(has_zero) is has_zero
    (True, True)
    >>> torch.func.vmap(lambda x: (has_zero(x), x)[1])(torch.tensor([[0, 1]])).tolist()
    [[0, 1]]
    """
    if getattr(fn, MARK, False):
        return fn

    @functools.wraps(fn)
    def skipped_inside_transforms(*args: P.args, **kwargs: P.kwargs) -> R | None:
        if in_transform():
            return None
        return fn(*args, **kwargs)

    setattr(skipped_inside_transforms, MARK, True)
    return skipped_inside_transforms
