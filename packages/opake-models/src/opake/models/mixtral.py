"""Mixtral: Mistral's decoder with a sparse mixture of experts (top-2 of 8) in every layer.

>>> from opake.models import mixtral
>>> mixtral.SPEC.moe.block
'MixtralSparseMoeBlock'
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
    name="mixtral",
    model_types=("mixtral",),
    layer="MixtralDecoderLayer",
    mlp=None,
    norm=Norm("rms", "MixtralRMSNorm", "pre"),
    rope=Rope("rotate_half", "MixtralRotaryEmbedding"),
    attention=Attention("causal", sliding_window="sliding_window"),
    head=CausalLMHead(),
    models=("MixtralForCausalLM",),
    tiny_config={**TINY_DECODER, **TINY_MOE, "sliding_window": 4},
    moe=Moe("MixtralSparseMoeBlock", normalize=True, jitter="router_jitter_noise"),
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one Mixtral model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
