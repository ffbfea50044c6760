"""``nn.Linear`` (LoRA adapters included): ``W`` by the ghost or materialised route, the bias
directly.

The per-example gradient of ``y = x Wᵀ + b`` over a sequence is ``Σ_t g_t ⊗ x_t`` (an
:class:`~opake.dpsgd.bookkeeping.OuterSum`; its norm by the Gram identity or materialised,
whichever :func:`~opake.dpsgd.bookkeeping.ghost_is_cheaper` says) and ``Σ_t g_t`` for the bias.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opake.core.plugins import BookkeepingRule
from opake.dpsgd.bookkeeping._pieces import Dense, OuterSum
from opake.dpsgd.bookkeeping._use import LayerUse, RuleExample, first_input, flat_batch
from opake.dpsgd.bookkeeping.rules._match import plain

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping._pieces import Piece

__all__ = ["RULE", "bias_piece", "example", "matches", "pieces"]


def matches(module: torch.nn.Module, attrs: frozenset[str]) -> bool:
    """A plain ``nn.Linear`` (not a subclass with its own forward)."""
    import torch

    return plain(module, torch.nn.Linear)


def bias_piece(g: torch.Tensor) -> Dense:
    """The bias's per-example gradient ``Σ_t g_t`` from output gradients ``[B, T, d]``."""
    return Dense(g.float().sum(dim=1))


def pieces(use: LayerUse) -> dict[str, Piece]:
    """``weight``: ``OuterSum(g, x)``; ``bias``: ``Σ_t g_t``."""
    assert use.grad is not None
    name = use.layer.module
    g = flat_batch(use.grad, use.batch, name)
    x = flat_batch(first_input(use), use.batch, name)
    out: dict[str, Piece] = {}
    if "weight" in use.attrs:
        out["weight"] = OuterSum(g, x)
    if "bias" in use.attrs:
        out["bias"] = bias_piece(g)
    return out


def example() -> tuple[RuleExample, ...]:
    """16 → 16 over 4 tokens (the Gram route) and 4 → 3 over 24 tokens (materialised)."""
    import torch

    return (
        RuleExample(torch.nn.Linear(16, 16), width=16, steps=4),
        RuleExample(torch.nn.Linear(4, 3), width=4, steps=24),
    )


RULE = BookkeepingRule(
    "linear",
    matches=matches,
    pieces=pieces,
    produces={"weight": "outer", "bias": "dense"},
    example=example,
)
