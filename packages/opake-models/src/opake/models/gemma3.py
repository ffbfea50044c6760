"""Gemma 3 (text): Gemma 2's sandwich norms with QK-norm, sliding/full layers (5:1 in the
released models), separate RoPE bases per layer type, optional softcaps, tied head.

>>> from opake.models import gemma3
>>> gemma3.SPEC.layer
'Gemma3DecoderLayer'
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
    name="gemma3",
    model_types=("gemma3_text",),
    layer="Gemma3DecoderLayer",
    mlp=Mlp("geglu", "Gemma3MLP"),
    norm=Norm("rms", "Gemma3RMSNorm", "sandwich", eps="eps", offset=1.0),
    rope=Rope("rotate_half", "Gemma3RotaryEmbedding"),
    attention=Attention(
        "causal",
        sliding_window="sliding_window",
        layer_types=True,
        softcap="attn_logit_softcapping",
        qk_norm=True,
    ),
    head=CausalLMHead(tied=True, final_softcap="final_logit_softcapping"),
    models=("Gemma3ForCausalLM",),
    tiny_config={
        **TINY_DECODER,
        "head_dim": 8,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
        "final_logit_softcapping": 3.0,
        "attn_logit_softcapping": 10.0,
        "query_pre_attn_scalar": 8,
    },
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one Gemma 3 text model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
