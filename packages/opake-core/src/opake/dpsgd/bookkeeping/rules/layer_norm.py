"""``nn.LayerNorm``: ``Σ_t g_t ⊙ x̂_t`` for the weight, ``Σ_t g_t`` for the bias."""

from __future__ import annotations

from typing import TYPE_CHECKING

from opake.core.plugins import BookkeepingRule
from opake.dpsgd.bookkeeping._use import LayerUse, RuleExample, first_input
from opake.dpsgd.bookkeeping.rules._match import plain
from opake.dpsgd.bookkeeping.rules._norm import norm_pieces

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping._rules import Piece

__all__ = ["RULE", "example", "matches", "pieces"]


def matches(module: torch.nn.Module, attrs: frozenset[str]) -> bool:
    """A plain ``nn.LayerNorm``."""
    import torch

    return plain(module, torch.nn.LayerNorm)


def pieces(use: LayerUse) -> dict[str, Piece]:
    """``x̂`` by ``F.layer_norm`` over the module's ``normalized_shape``."""
    import torch.nn.functional as F

    module = use.module
    shape = tuple(module.normalized_shape)  # type: ignore[arg-type]
    x = first_input(use).float().reshape(use.batch, -1, *shape)
    return norm_pieces(use, F.layer_norm(x, shape, eps=module.eps))  # type: ignore[arg-type]


def example() -> RuleExample:
    """A ``LayerNorm(8)`` over 5 tokens."""
    import torch

    return RuleExample(torch.nn.LayerNorm(8), width=8)


RULE = BookkeepingRule(
    "layer_norm",
    matches=matches,
    pieces=pieces,
    produces={"weight": "dense", "bias": "dense"},
    example=example,
)
