"""Mellum: Llama-style attention with sliding/full layers, and per ``config.mlp_layer_types``
a sparse MoE block or a dense SwiGLU MLP in each layer.

>>> from opake.models import mellum
>>> mellum.SPEC.moe.block
'MellumSparseMoeBlock'
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
    name="mellum",
    model_types=("mellum",),
    layer="MellumDecoderLayer",
    mlp=Mlp("swiglu", "MellumMLP"),
    norm=Norm("rms", "MellumRMSNorm", "pre"),
    rope=Rope("rotate_half", "MellumRotaryEmbedding"),
    attention=Attention("causal", sliding_window="sliding_window", layer_types=True),
    head=CausalLMHead(),
    models=("MellumForCausalLM",),
    tiny_config={
        **TINY_DECODER,
        **TINY_MOE,
        "head_dim": 8,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
        "mlp_layer_types": ["sparse", "dense"],
    },
    moe=Moe("MellumSparseMoeBlock"),
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one Mellum model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
