"""GLM-4: fused gate/up SwiGLU, RMSNorm before and after each sublayer, partial interleaved
RoPE, untied head.

>>> from opake.models import glm4
>>> glm4.SPEC.layer
'Glm4DecoderLayer'
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
    name="glm4",
    model_types=("glm4",),
    layer="Glm4DecoderLayer",
    mlp=Mlp("swiglu", "Glm4MLP", gate=None, up=None, gate_up="gate_up_proj", act="activation_fn"),
    norm=Norm("rms", "Glm4RMSNorm", "sandwich"),
    rope=Rope("interleaved", "Glm4RotaryEmbedding", partial=True),
    attention=Attention("causal"),
    head=CausalLMHead(),
    models=("Glm4ForCausalLM",),
    tiny_config={**TINY_DECODER, "head_dim": 8, "attention_bias": True},
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one GLM-4 model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
