"""GPT-OSS: sliding/full layers with learned attention sinks, YaRN RoPE, and a sparse MoE in
every layer (top-k logits, softmax over those k; experts with biases and a clamped SwiGLU).

>>> from opake.models import gpt_oss
>>> gpt_oss.SPEC.moe.block
'GptOssMLP'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opake.models._apply import FamilyReport, apply_family
from opake.models._spec import Attention, CausalLMHead, FamilySpec, Moe, Norm, Rope
from opake.models._tiny import TINY_DECODER, TINY_MOE

if TYPE_CHECKING:
    import torch

    from opake.patches import PatchOptions

__all__ = ["SPEC", "apply"]

SPEC = FamilySpec(
    name="gpt_oss",
    model_types=("gpt_oss",),
    layer="GptOssDecoderLayer",
    mlp=None,
    norm=Norm("rms", "GptOssRMSNorm", "pre"),
    rope=Rope("rotate_half", "GptOssRotaryEmbedding"),
    attention=Attention("causal", sliding_window="sliding_window", layer_types=True, sinks=True),
    head=CausalLMHead(),
    models=("GptOssForCausalLM",),
    tiny_config={
        **TINY_DECODER,
        **TINY_MOE,
        "intermediate_size": 16,
        "head_dim": 8,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    moe=Moe(
        "GptOssMLP", router="router", routing="topk_softmax", normalize=False, returns_scores=True
    ),
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one GPT-OSS model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
