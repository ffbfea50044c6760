"""Ministral: Mistral's block with sliding and full layers per ``config.layer_types``.

>>> from opake.models import ministral
>>> ministral.SPEC.layer
'MinistralDecoderLayer'
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
    name="ministral",
    model_types=("ministral",),
    layer="MinistralDecoderLayer",
    mlp=Mlp("swiglu", "MinistralMLP"),
    norm=Norm("rms", "MinistralRMSNorm", "pre"),
    rope=Rope("rotate_half", "MinistralRotaryEmbedding"),
    attention=Attention("causal", sliding_window="sliding_window", layer_types=True),
    head=CausalLMHead(),
    models=("MinistralForCausalLM",),
    tiny_config={
        **TINY_DECODER,
        "head_dim": 8,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
    },
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one Ministral model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
