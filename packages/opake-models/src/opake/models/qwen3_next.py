"""Qwen3-Next: hybrid layers — gated delta-net linear attention and gated full attention
(QK-norm, partial RoPE) — each followed by a sparse MoE with a sigmoid-gated shared expert.

>>> from opake.models import qwen3_next
>>> qwen3_next.SPEC.attention.linear
'Qwen3NextGatedDeltaNet'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opake.models._apply import FamilyReport, apply_family
from opake.models._spec import Attention, CausalLMHead, FamilySpec, Mlp, Moe, Norm, Rope
from opake.models._tiny import TINY_DECODER, TINY_MOE

if TYPE_CHECKING:
    import torch

    from opake.patches import PatchOptions

__all__ = ["SPEC", "apply"]

SPEC = FamilySpec(
    name="qwen3_next",
    model_types=("qwen3_next",),
    layer="Qwen3NextDecoderLayer",
    mlp=Mlp("swiglu", "Qwen3NextMLP"),
    norm=Norm("rms", "Qwen3NextRMSNorm", "pre", eps="eps", offset=1.0),
    rope=Rope("rotate_half", "Qwen3NextRotaryEmbedding", partial=True),
    attention=Attention("causal", layer_types=True, qk_norm=True, linear="Qwen3NextGatedDeltaNet"),
    head=CausalLMHead(),
    models=("Qwen3NextForCausalLM",),
    tiny_config={
        **TINY_DECODER,
        **TINY_MOE,
        "head_dim": 8,
        "layer_types": ["full_attention", "linear_attention"],  # pads are non-zero by layer 1
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "shared_expert_intermediate_size": 16,
        "norm_topk_prob": True,
    },
    moe=Moe("Qwen3NextSparseMoeBlock", shared="shared_expert", shared_gate="shared_expert_gate"),
    bookkeeping_frozen={
        ".linear_attn.conv1d.": "its weight is read outside its module (no recorded call)",
        ".linear_attn.norm.": "the gated norm sees the tokens flattened across examples",
    },
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one Qwen3-Next model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
