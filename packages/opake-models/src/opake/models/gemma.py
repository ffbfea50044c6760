"""Gemma: GeGLU (tanh) MLP, RMSNorm with ``(1 + w)``, scaled embeddings, head tied to them.

>>> from opake.models import gemma
>>> gemma.SPEC.layer
'GemmaDecoderLayer'
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
    name="gemma",
    model_types=("gemma",),
    layer="GemmaDecoderLayer",
    mlp=Mlp("geglu", "GemmaMLP"),
    norm=Norm("rms", "GemmaRMSNorm", "pre", eps="eps", offset=1.0),
    rope=Rope("rotate_half", "GemmaRotaryEmbedding"),
    attention=Attention("causal"),
    head=CausalLMHead(tied=True),
    models=("GemmaForCausalLM",),
    tiny_config={**TINY_DECODER, "head_dim": 8},
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one Gemma model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
