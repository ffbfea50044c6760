"""Hunyuan (v1 MoE): QK-norm attention and, in every layer, a shared SwiGLU MLP plus a sparse
MoE whose router is an fp32 linear (softmax, top-k, renormalised).

>>> from opake.models import hunyuan_v1_moe
>>> hunyuan_v1_moe.SPEC.moe.block
'HunYuanMoEV1Moe'
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
    name="hunyuan_v1_moe",
    model_types=("hunyuan_v1_moe",),
    layer="HunYuanMoEV1DecoderLayer",
    mlp=Mlp("swiglu", "HunYuanMoEV1MLP"),
    norm=Norm("rms", "HunYuanMoEV1RMSNorm", "pre"),
    rope=Rope("rotate_half", "HunYuanMoEV1RotaryEmbedding"),
    attention=Attention("causal", qk_norm=True),
    head=CausalLMHead(),
    models=("HunYuanMoEV1ForCausalLM",),
    tiny_config={**TINY_DECODER, **TINY_MOE, "head_dim": 8, "moe_topk": 2, "use_qk_norm": True},
    moe=Moe(
        "HunYuanMoEV1Moe", router_linear="wg", normalize=True, shared="shared_mlp", aux_loss=False
    ),
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one Hunyuan v1 MoE model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
