"""Cohere (Command R): one bias-free LayerNorm feeding attention and MLP in parallel,
interleaved RoPE, tied head, logits multiplied by ``logit_scale``.

>>> from opake.models import cohere
>>> cohere.SPEC.layer
'CohereDecoderLayer'
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
    name="cohere",
    model_types=("cohere",),
    layer="CohereDecoderLayer",
    mlp=Mlp("swiglu", "CohereMLP"),
    norm=Norm("layer", "CohereLayerNorm", "parallel"),
    rope=Rope("interleaved", "CohereRotaryEmbedding"),
    attention=Attention("causal"),
    head=CausalLMHead(tied=True, logit_scale="logit_scale"),
    models=("CohereForCausalLM",),
    tiny_config={**TINY_DECODER, "logit_scale": 0.5, "use_qk_norm": True},
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one Cohere model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
