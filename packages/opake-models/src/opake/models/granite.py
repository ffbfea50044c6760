"""Granite: Llama's shape with embedding/residual/attention multipliers; logits divided by
``logits_scaling``.

>>> from opake.models import granite
>>> granite.SPEC.layer
'GraniteDecoderLayer'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opake.models._apply import FamilyReport, apply_family
from opake.models._spec import Attention, CausalLMHead, FamilySpec, Mlp, Norm, Rope
from opake.models._tiny import TINY_DECODER

if TYPE_CHECKING:
    import torch

    from opake.patches import PatchOptions

__all__ = ["SPEC", "apply"]

SPEC = FamilySpec(
    name="granite",
    model_types=("granite",),
    layer="GraniteDecoderLayer",
    mlp=Mlp("swiglu", "GraniteMLP"),
    norm=Norm("rms", "GraniteRMSNorm", "pre"),
    rope=Rope("rotate_half", "GraniteRotaryEmbedding"),
    attention=Attention("causal"),
    head=CausalLMHead(logit_divisor="logits_scaling"),
    models=("GraniteForCausalLM",),
    tiny_config={
        **TINY_DECODER,
        "logits_scaling": 4.0,
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.25,
    },
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one Granite model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
