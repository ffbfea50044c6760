"""Cheaper ``apply`` for ``torch.autograd.Function`` classes with ``setup_context``."""

from __future__ import annotations

import inspect
from typing import TypeVar

from opake.core.errors import InputTypeError

__all__ = ["cached_signature"]

F = TypeVar("F", bound=type)


def cached_signature(cls: F) -> F:
    """Class decorator: compute the signature of ``cls.forward`` once instead of on every call.

    For a ``torch.autograd.Function`` that defines ``setup_context`` (the form ``vmap`` and
    ``grad`` need), torch's ``Function.apply`` binds the call's arguments to
    ``inspect.signature(cls.forward)`` every time, which derives the signature anew (tens of
    microseconds: on a small model's training step, a few percent). ``inspect.signature``
    returns a function's ``__signature__`` attribute when it has one, so setting it once keeps
    the binding exactly as before (defaults and keywords included) without the cost.

    >>> import torch
    >>> @cached_signature
    ... class Double(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(x, scale=2.0):
    ...         return x * scale
    ...     @staticmethod
    ...     def setup_context(ctx, inputs, output):
    ...         ctx.scale = inputs[1]
    ...     @staticmethod
    ...     def backward(ctx, grad):
    ...         return grad * ctx.scale, None
    >>> Double.apply(torch.ones(2)).tolist()  # the default is bound as before
    [2.0, 2.0]
    """
    forward = inspect.getattr_static(cls, "forward", None)
    function = forward.__func__ if isinstance(forward, staticmethod) else None
    if function is None or not inspect.isfunction(function):
        raise InputTypeError(
            f"cached_signature: {getattr(cls, '__name__', cls)!r} has no staticmethod forward; "
            "decorate a torch.autograd.Function subclass that defines forward (and "
            "setup_context) as static methods"
        )
    # through __dict__: typeshed's FunctionType declares no __signature__ (the same attribute)
    vars(function)["__signature__"] = inspect.signature(function)
    return cls
