"""Gemma 2: Gemma with norms around each sublayer, alternating sliding/full layers,
attention-logit and final-logit softcaps.

>>> from opake.models import gemma2
>>> gemma2.SPEC.layer
'Gemma2DecoderLayer'
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
    name="gemma2",
    model_types=("gemma2",),
    layer="Gemma2DecoderLayer",
    mlp=Mlp("geglu", "Gemma2MLP"),
    norm=Norm("rms", "Gemma2RMSNorm", "sandwich", eps="eps", offset=1.0),
    rope=Rope("rotate_half", "Gemma2RotaryEmbedding"),
    attention=Attention(
        "causal",
        sliding_window="sliding_window",
        layer_types=True,
        softcap="attn_logit_softcapping",
    ),
    head=CausalLMHead(tied=True, final_softcap="final_logit_softcapping"),
    models=("Gemma2ForCausalLM",),
    tiny_config={
        **TINY_DECODER,
        "head_dim": 8,
        "sliding_window": 4,
        "final_logit_softcapping": 3.0,
        "attn_logit_softcapping": 10.0,
        "query_pre_attn_scalar": 8,
    },
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one Gemma2 model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
