"""Helpers shared by every op's Function pair: folding the vmapped dimension, per-example runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol

import torch

from opake.core.errors import OperationError

__all__ = [
    "Tensor",
    "apply",
    "apply_tensor",
    "fold",
    "front",
    "no_double_backward",
    "no_setup",
    "per_example",
    "squeeze_group",
]

Tensor = torch.Tensor


def _no_double_backward(ctx: Any, *grad_outputs: Any) -> NoReturn:
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


def _pick(t: object, dim: int | None, i: int) -> object:
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


def _no_setup(ctx: Any, inputs: Any, output: Any) -> None:
    """``setup_context`` of a backward Function: it saves nothing."""
    return


no_double_backward = _no_double_backward
no_setup = _no_setup
fold = _fold
front = _front
per_example = _per_example
squeeze_group = _squeeze_group


class FunctionClass(Protocol):
    """A ``torch.autograd.Function`` subclass, as called here: torch leaves ``apply`` untyped."""

    def apply(self, *args: Any) -> Any: ...


def apply(fn: FunctionClass, *args: Any) -> Any:
    """``fn.apply(*args)``: the Function's outputs (a tensor, or a tuple of tensors and
    ``None`` for the inputs that get no gradient: Any, each Function has its own)."""
    return fn.apply(*args)


def apply_tensor(fn: FunctionClass, *args: Any) -> Tensor:
    """``fn.apply(*args)`` for a Function with one tensor output."""
    out: Tensor = fn.apply(*args)
    return out
