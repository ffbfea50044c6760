"""``nn.Embedding`` (and Hugging Face's ``*ScaledWordEmbedding``): index matching.

The per-example gradient is ``Σ_t onehot(id_t) ⊗ e_t`` (an
:class:`~opake.dpsgd.bookkeeping.OuterSum` held as indices): its norm is
``Σ_{t,s} [id_t = id_s] (e_t·e_s)``; padding ids contribute nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opake.core.plugins import BookkeepingRule
from opake.dpsgd.bookkeeping._pieces import OuterSum
from opake.dpsgd.bookkeeping._use import LayerUse, RuleExample, first_input, flat_batch
from opake.dpsgd.bookkeeping.rules._match import embed_scale, plain

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping._pieces import Piece

__all__ = ["RULE", "example", "matches", "pieces"]


def matches(module: torch.nn.Module, attrs: frozenset[str]) -> bool | str:
    """A plain ``nn.Embedding`` or a scaled word embedding, without ``max_norm``,
    ``scale_grad_by_freq`` or ``sparse`` (those are reported unsupported)."""
    import torch

    if not (plain(module, torch.nn.Embedding) or embed_scale(module) is not None):
        return False
    assert isinstance(module, torch.nn.Embedding)
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        return (
            "an nn.Embedding with max_norm, scale_grad_by_freq or sparse=True has no "
            "book-keeping rule"
        )
    return True


def pieces(use: LayerUse) -> dict[str, Piece]:
    """``weight``: ``OuterSum(ids, e)`` with the padding rows zeroed and the scale applied."""
    import torch

    assert use.grad is not None
    batch, module = use.batch, use.module
    x = first_input(use)
    if x.dim() < 1 or x.shape[0] != batch:
        flat_batch(x, batch, use.layer.module)  # raises
    ids = x.reshape(batch, -1)
    e = use.grad.reshape(batch, ids.shape[1], -1)
    pad = getattr(module, "padding_idx", None)
    if pad is not None:
        e = e * (ids != pad)[..., None].to(e.dtype)
    scale = embed_scale(module)
    if scale is not None:  # output = embedding(ids) * scale (in the weight's dtype)
        weight = use.params["weight"]
        factor = torch.as_tensor(scale, device=e.device).to(weight.dtype)
        e = e.float() * factor.float()
    rows = int(getattr(module, "num_embeddings", 0))
    return {"weight": OuterSum(ids, e, rows=rows)}


def example() -> RuleExample:
    """12 rows of width 8, padding id 0, over 6 tokens."""
    import torch

    return RuleExample(torch.nn.Embedding(12, 8, padding_idx=0), width=12, tokens=True, steps=6)


RULE = BookkeepingRule(
    "embedding",
    matches=matches,
    pieces=pieces,
    produces={"weight": "outer"},
    example=example,
)
