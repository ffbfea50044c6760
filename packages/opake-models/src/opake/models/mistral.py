"""Mistral: Llama's shape with a sliding attention window on every layer.

>>> from opake.models import mistral
>>> mistral.SPEC.layer
'MistralDecoderLayer'
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
    name="mistral",
    model_types=("mistral",),
    layer="MistralDecoderLayer",
    mlp=Mlp("swiglu", "MistralMLP"),
    norm=Norm("rms", "MistralRMSNorm", "pre"),
    rope=Rope("rotate_half", "MistralRotaryEmbedding"),
    attention=Attention("causal", sliding_window="sliding_window"),
    head=CausalLMHead(),
    models=("MistralForCausalLM",),
    tiny_config={**TINY_DECODER, "sliding_window": 4},
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one Mistral model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
