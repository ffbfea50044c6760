"""Llama: SwiGLU MLP, RMSNorm before each sublayer, rotate-half RoPE, untied head.

>>> from opake.models import llama
>>> llama.SPEC.layer
'LlamaDecoderLayer'
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
    name="llama",
    model_types=("llama",),
    layer="LlamaDecoderLayer",
    mlp=Mlp("swiglu", "LlamaMLP"),
    norm=Norm("rms", "LlamaRMSNorm", "pre"),
    rope=Rope("rotate_half", "LlamaRotaryEmbedding"),
    attention=Attention("causal"),
    head=CausalLMHead(),
    models=("LlamaForCausalLM",),
    tiny_config=dict(TINY_DECODER),
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one Llama model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
