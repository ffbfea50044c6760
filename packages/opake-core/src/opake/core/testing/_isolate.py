"""One example's contribution to a clipped sum, and its norm measured exactly (test helpers)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["contribution", "exact_norm"]


def exact_norm(grads: Mapping[str, torch.Tensor]) -> float:
    """``‖grads‖`` over every tensor: exact squares of the entries summed by ``math.fsum`` (the
    only rounding is the final square root's and fp64's conversion of the sum).

    >>> import torch
    >>> exact_norm({"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]])})
    5.0
    """
    squares = [v for g in grads.values() for v in g.double().square().flatten().tolist()]
    return math.sqrt(math.fsum(squares))


def contribution(
    grad_fn: Callable[..., Any], args: tuple[object, ...], *, state: object, index: int, batch: int
) -> dict[str, torch.Tensor]:
    """What example ``index`` alone adds to ``grad_fn``'s clipped sum: the call with an
    ``example_mask`` that keeps only that example (the others then add exact zeros). Returns
    the gradients (without the aux of a ``return_aux`` ``grad_fn``).

    >>> import torch
    >>> from opake.dpsgd.clipping import clipped_grad
    >>> fn, state = clipped_grad(lambda p, x: (p["w"] * x).sum(), clipping_norm=1.0)
    >>> args = ({"w": torch.zeros(2)}, torch.ones(3, 2))
    >>> got = contribution(fn, args, state=state, index=1, batch=3)
    >>> exact_norm(got) <= 1.0  # its gradient, norm √2, clipped to C = 1
    True
    """
    import torch

    mask = torch.zeros(batch, dtype=torch.bool)
    mask[index] = True
    out, _ = grad_fn(*args, state=state, example_mask=mask)
    grads: dict[str, torch.Tensor] = out[0] if isinstance(out, tuple) else out
    return grads
