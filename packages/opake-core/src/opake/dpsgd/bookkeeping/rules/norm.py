"""PyTorch's own norm modules, one implementation for both rules.

``nn.LayerNorm`` (rule ``layer_norm``: ``Σ_t g_t ⊙ x̂_t`` for the weight, ``Σ_t g_t`` for the
bias) and ``nn.RMSNorm`` (rule ``rms_norm``: ``Σ_t g_t ⊙ x̂_t`` for the weight) differ only in
the module class and the function that computes ``x̂``; :class:`TorchNorm` holds that pair and
gives the rule's ``matches``, ``pieces`` and ``example``. Both rules are ``eager``: their pieces
(``[B, d]`` per-example gradients) are built in the backward, releasing the layer's input and
output gradient there.

>>> [(rule.name, rule.eager) for rule in (LAYER_NORM, RMS_NORM)]
[('layer_norm', True), ('rms_norm', True)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from opake.core.plugins import BookkeepingRule
from opake.dpsgd.bookkeeping._use import LayerUse, RuleExample, first_input
from opake.dpsgd.bookkeeping.rules._match import plain
from opake.dpsgd.bookkeeping.rules._norm import norm_pieces

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping._pieces import Piece

__all__ = ["LAYER_NORM", "RMS_NORM", "TorchNorm"]


@dataclass(frozen=True)
class TorchNorm:
    """A ``torch.nn`` norm class (``"LayerNorm"``) and the ``torch.nn.functional`` function that
    normalises like it (``"layer_norm"``), over the module's ``normalized_shape``.

    >>> import torch
    >>> norm = TorchNorm("RMSNorm", "rms_norm")
    >>> norm.matches(torch.nn.RMSNorm(4), frozenset({"weight"}))
    True
    >>> norm.matches(torch.nn.LayerNorm(4), frozenset({"weight"}))
    False
    """

    module: str
    functional: str

    def matches(self, module: torch.nn.Module, attrs: frozenset[str]) -> bool:
        """A plain module of the class (not a subclass with its own forward)."""
        import torch

        return plain(module, getattr(torch.nn, self.module))

    def pieces(self, use: LayerUse) -> dict[str, Piece]:
        """``x̂`` by the functional over the module's ``normalized_shape`` and ``eps``."""
        import torch
        import torch.nn.functional as F

        module = use.module
        assert isinstance(module, torch.nn.LayerNorm | torch.nn.RMSNorm)  # what matches() takes
        shape = tuple(module.normalized_shape)
        x = first_input(use).float().reshape(use.batch, -1, *shape)
        normalise = getattr(F, self.functional)
        return norm_pieces(use, normalise(x, shape, eps=module.eps))

    def example(self) -> RuleExample:
        """The module of width 8 over 5 tokens."""
        import torch

        return RuleExample(getattr(torch.nn, self.module)(8), width=8)

    def rule(self, name: str, produces: dict[str, str]) -> BookkeepingRule:
        """The eager :class:`~opake.core.plugins.BookkeepingRule` named ``name``."""
        return BookkeepingRule(
            name,
            matches=self.matches,
            pieces=self.pieces,
            produces=produces,
            example=self.example,
            eager=True,
        )


LAYER_NORM = TorchNorm("LayerNorm", "layer_norm").rule(
    "layer_norm", {"weight": "dense", "bias": "dense"}
)
RMS_NORM = TorchNorm("RMSNorm", "rms_norm").rule("rms_norm", {"weight": "dense"})
