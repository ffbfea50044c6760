"""The book-keeping rule of the families' own norm layers, declared by their specs.

Every :class:`~opake.models.FamilySpec` names its norm module and its formula
(:class:`~opake.models.Norm`: ``kind`` ``"rms"`` or ``"layer"``, the ``eps`` attribute, the
weight ``offset``): Llama-style ``w ⊙ x̂``, Gemma-style ``(1 + w) ⊙ x̂`` (``offset=1.0``),
Cohere's mean-subtracted LayerNorm without bias. From that declaration the per-example gradient
of the weight is ``Σ_t g_t ⊙ x̂_t`` (closed form, no ``vmap``). The rule checks on every call that
the module's recorded output is the declared formula of its input, so a declaration that does
not fit the module raises :class:`~opake.core.errors.OperationError` (``engine="auto"`` then
runs the vmap engine) instead of giving wrong norms. PyTorch's own ``nn.LayerNorm`` /
``nn.RMSNorm`` keep their built-in rules.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from opake.core.errors import ConfigurationError
from opake.core.plugins import BookkeepingRule

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping.rules import LayerUse, Piece, RuleExample
    from opake.models._spec import Norm

__all__ = ["RULE", "declared_norms", "example", "matches", "pieces"]


@functools.cache
def declared_norms() -> dict[str, Norm]:
    """Norm class name → its declaration, over opake-models' families (a class declared twice
    with different formulas raises).

    >>> declared_norms()["GemmaRMSNorm"].offset
    1.0
    """
    from opake.models._registry import family_names, family_spec

    out: dict[str, Norm] = {}
    for name in family_names():
        norm = family_spec(name).norm
        if norm is None:
            continue
        known = out.setdefault(norm.module, norm)
        if (known.kind, known.eps, known.offset) != (norm.kind, norm.eps, norm.offset):
            raise ConfigurationError(
                f"norm class {norm.module!r} is declared twice with different formulas: "
                f"{known} and {norm} (family {name!r})"
            )
    return out


def _declaration(module: torch.nn.Module) -> Norm | None:
    cls = type(module)
    if not cls.__module__.startswith("transformers."):
        return None
    return declared_norms().get(cls.__name__)


def matches(module: torch.nn.Module, attrs: frozenset[str]) -> bool | str:
    """A Hugging Face norm module a family spec declares, holding its ``eps`` attribute."""
    norm = _declaration(module)
    if norm is None:
        return False
    eps = getattr(module, norm.eps, None)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return (
            f"{type(module).__name__} has no number in attribute {norm.eps!r}, where its family "
            "spec declares epsilon"
        )
    return True


def pieces(use: LayerUse) -> dict[str, Piece]:
    """``Σ_t g_t ⊙ x̂_t`` (weight) and ``Σ_t g_t`` (bias), after checking the output."""
    from opake.dpsgd.bookkeeping.rules import first_input, last_dim_normalised, norm_pieces

    norm = _declaration(use.module)
    assert norm is not None
    eps = float(getattr(use.module, norm.eps))
    h = last_dim_normalised(first_input(use), norm.kind, eps)
    return norm_pieces(use, h, offset=norm.offset, check=True)


def _norm_class(family: str) -> type[torch.nn.Module]:
    import sys

    import transformers

    from opake.models._registry import family_spec

    spec = family_spec(family)
    assert spec.norm is not None
    model_cls = getattr(transformers, spec.models[0])
    norm_cls: type[torch.nn.Module] = getattr(sys.modules[model_cls.__module__], spec.norm.module)
    return norm_cls


def example() -> tuple[RuleExample, ...]:
    """One module per declared formula: Llama's RMSNorm, Gemma's ``(1 + w)`` RMSNorm and
    Cohere's bias-free LayerNorm, with random weights, over 5 tokens of width 8."""
    import torch

    from opake.dpsgd.bookkeeping.rules import RuleExample

    out = []
    for family in ("llama", "gemma", "cohere"):
        module = _norm_class(family)(8)
        torch.nn.init.normal_(module.get_parameter("weight"))
        out.append(RuleExample(module, width=8))
    return tuple(out)


RULE = BookkeepingRule(
    "family_norm",
    matches="opake.models._norm_rule:matches",
    pieces="opake.models._norm_rule:pieces",
    produces={"weight": "dense", "bias": "dense"},
    example="opake.models._norm_rule:example",
    keeps_output=True,
    eager=True,  # [B, d] pieces built in the backward: the input and output gradient released
)
