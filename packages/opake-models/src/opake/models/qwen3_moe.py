"""Qwen3-MoE: Qwen 3's attention (QK-norm) with a sparse MoE block in every layer except
``mlp_only_layers`` (dense SwiGLU there); top-k renormalised when ``norm_topk_prob``.

>>> from opake.models import qwen3_moe
>>> qwen3_moe.SPEC.moe.block
'Qwen3MoeSparseMoeBlock'
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
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    layer="Qwen3MoeDecoderLayer",
    mlp=Mlp("swiglu", "Qwen3MoeMLP"),
    norm=Norm("rms", "Qwen3MoeRMSNorm", "pre"),
    rope=Rope("rotate_half", "Qwen3MoeRotaryEmbedding"),
    attention=Attention("causal", sliding_window="sliding_window", qk_norm=True),
    head=CausalLMHead(),
    models=("Qwen3MoeForCausalLM",),
    tiny_config={**TINY_DECODER, **TINY_MOE, "norm_topk_prob": True, "mlp_only_layers": [1]},
    moe=Moe("Qwen3MoeSparseMoeBlock"),
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one Qwen3-MoE model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
