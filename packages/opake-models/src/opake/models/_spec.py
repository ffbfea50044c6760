"""The declarative description of one Hugging Face model family (what an adapter knows).

A family module (``opake.models.llama`` …) is one :class:`FamilySpec` and a one-line ``apply``.
Everything :func:`opake.models.apply_family` does is read from the spec: where the decoder
layers are (the checkpoint boundary), which MLP and norm modules a kernel may replace, how the
attention mask must be built, and the head — its weight, whether it is tied to the embedding
and how logits are transformed. The loss-only path and the logits path are both computed from
the same :class:`LogitTransform`, so they cannot drift apart.

Nothing here imports torch or transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from opake.core.errors import ConfigurationError, InputTypeError
from opake.models._spec_checks import (
    MLP_KINDS,
    NORM_KINDS,
    NORM_PLACEMENTS,
    ROPE_KINDS,
    ROUTINGS,
    TASKS,
    ident,
)
from opake.models._spec_heads import CausalLMHead, ClassifierHead, LogitTransform
from opake.models._spec_layers import Attention, Mlp, Norm, Rope
from opake.models._spec_moe import Moe

__all__ = [
    "MLP_KINDS",
    "NORM_KINDS",
    "NORM_PLACEMENTS",
    "ROPE_KINDS",
    "ROUTINGS",
    "TASKS",
    "Attention",
    "CausalLMHead",
    "ClassifierHead",
    "FamilySpec",
    "LogitTransform",
    "Mlp",
    "Moe",
    "Norm",
    "Rope",
]

#: MLP shapes: ``down(silu(gate) * up)``, ``down(gelu(gate) * up)``, ``fc2(gelu(fc1(x)))``


@dataclass(frozen=True)
class FamilySpec:
    """Everything an adapter knows about one family of Hugging Face models.

    Args:
        name: the family name registered with Opake (``"llama"``).
        model_types: the ``config.model_type`` values it covers.
        layer: class name of one decoder (or encoder) layer — the gradient-checkpoint boundary;
            the adapter finds the layers by class and checks there are
            ``config.num_hidden_layers`` of them.
        mlp: the dense (gated) MLP, see :class:`Mlp`; None for a family whose every
            feed-forward block is a mixture of experts (Mixtral).
        norm: the normalisation layers, see :class:`Norm`.
        rope: the rotary embedding, see :class:`Rope`.
        attention: the attention and its mask, see :class:`Attention`.
        head: :class:`CausalLMHead` or :class:`ClassifierHead`.
        models: class names of the task models the adapter patches (``"LlamaForCausalLM"``).
        tiny_config: config keyword arguments of a tiny model that exercises every quirk of
            the family (hidden ≤ 64, 2 layers, vocab ≤ 256): the conformance suite and the
            benchmark build models from it.
        requires: the library versions the adapter targets.
        moe: the mixture-of-experts block, see :class:`Moe` (None: a dense family).
        bookkeeping_frozen: parameters the book-keeping engine cannot train, as parts of their
            names mapped to the reason (descriptive: it feeds the support table and the tests,
            which freeze them; trained, ``clipped_grad(engine="auto")`` picks vmap).

    Example:
        >>> from opake.models import family_spec
        >>> family_spec("gpt2").head.tied
        True
    """

    name: str
    model_types: tuple[str, ...]
    layer: str
    mlp: Mlp | None
    norm: Norm
    rope: Rope
    attention: Attention
    head: CausalLMHead | ClassifierHead
    models: tuple[str, ...]
    tiny_config: Mapping[str, Any]
    requires: str = "transformers>=5.17,<6"
    moe: Moe | None = None
    bookkeeping_frozen: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        owner = f"FamilySpec({self.name!r})"
        if not isinstance(self.model_types, tuple) or not self.model_types:
            raise InputTypeError(f"{owner}: model_types must be a non-empty tuple of strings.")
        ident(owner, "layer", self.layer)
        if self.mlp is None and self.moe is None:
            raise ConfigurationError(f"{owner}: give the dense MLP, the MoE block, or both.")
        if self.mlp is not None and not isinstance(self.mlp, Mlp):
            raise InputTypeError(f"{owner}: mlp must be a Mlp or None.")
        if self.moe is not None and not isinstance(self.moe, Moe):
            raise InputTypeError(f"{owner}: moe must be a Moe or None.")
        for what, kind in (
            ("norm", Norm),
            ("rope", Rope),
            ("attention", Attention),
        ):
            if not isinstance(getattr(self, what), kind):
                raise InputTypeError(f"{owner}: {what} must be a {kind.__name__}.")
        if not isinstance(self.head, (CausalLMHead, ClassifierHead)):
            raise InputTypeError(f"{owner}: head must be a CausalLMHead or a ClassifierHead.")
        if self.head.task == "sequence_classification" and self.attention.mask != "bidirectional":
            raise ConfigurationError(f"{owner}: a classifier family must use bidirectional masks.")
        if not isinstance(self.models, tuple) or not self.models:
            raise InputTypeError(f"{owner}: models must be a non-empty tuple of class names.")
        for cls in self.models:
            ident(owner, "models[]", cls)
        if not isinstance(self.tiny_config, Mapping):
            raise InputTypeError(f"{owner}: tiny_config must be a mapping of config arguments.")
        object.__setattr__(self, "tiny_config", MappingProxyType(dict(self.tiny_config)))
        frozen = self.bookkeeping_frozen
        if not isinstance(frozen, Mapping) or not all(
            isinstance(k, str) and k and isinstance(v, str) and v for k, v in frozen.items()
        ):
            raise InputTypeError(
                f"{owner}: bookkeeping_frozen must map parameter-name parts to the reason."
            )
        object.__setattr__(self, "bookkeeping_frozen", MappingProxyType(dict(frozen)))

    @property
    def task(self) -> str:
        """``"causal_lm"`` or ``"sequence_classification"``."""
        return self.head.task
