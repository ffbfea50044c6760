"""GPT-2's ``Conv1D`` (``y = x W + b`` with ``W`` stored ``[in, out]``): the transposed linear
rule, ``Σ_t x_t ⊗ g_t``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from opake.core.plugins import BookkeepingRule
from opake.dpsgd.bookkeeping._pieces import OuterSum
from opake.dpsgd.bookkeeping._use import LayerUse, RuleExample, first_input, flat_batch
from opake.dpsgd.bookkeeping.rules._match import is_conv1d
from opake.dpsgd.bookkeeping.rules.linear import bias_piece

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping._pieces import Piece

__all__ = ["RULE", "example", "matches", "pieces"]


def matches(module: torch.nn.Module, attrs: frozenset[str]) -> bool:
    """Hugging Face's ``transformers.pytorch_utils.Conv1D``."""
    return is_conv1d(module)


def pieces(use: LayerUse) -> dict[str, Piece]:
    """``weight``: ``OuterSum(x, g)``; ``bias``: ``Σ_t g_t``."""
    assert use.grad is not None
    name = use.layer.module
    g = flat_batch(use.grad, use.batch, name)
    x = flat_batch(first_input(use), use.batch, name)
    out: dict[str, Piece] = {}
    if "weight" in use.attrs:
        out["weight"] = OuterSum(x, g)
    if "bias" in use.attrs:
        out["bias"] = bias_piece(g)
    return out


def example() -> RuleExample:
    """A ``Conv1D(6, 8)`` (8 inputs, 6 outputs) over 5 tokens."""
    from transformers.pytorch_utils import Conv1D

    # transformers leaves Conv1D's constructor unannotated: Conv1D(nf, nx), stated
    conv1d: Callable[[int, int], torch.nn.Module] = Conv1D
    return RuleExample(conv1d(6, 8), width=8)


RULE = BookkeepingRule(
    "conv1d",
    matches=matches,
    pieces=pieces,
    produces={"weight": "outer", "bias": "dense"},
    example=example,
)
