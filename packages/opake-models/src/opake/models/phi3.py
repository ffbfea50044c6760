"""Phi-3: fused q/k/v and gate/up projections, partial RoPE, optional sliding window.

>>> from opake.models import phi3
>>> phi3.SPEC.layer
'Phi3DecoderLayer'
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
    name="phi3",
    model_types=("phi3",),
    layer="Phi3DecoderLayer",
    mlp=Mlp("swiglu", "Phi3MLP", gate=None, up=None, gate_up="gate_up_proj", act="activation_fn"),
    norm=Norm("rms", "Phi3RMSNorm", "pre"),
    rope=Rope("rotate_half", "Phi3RotaryEmbedding"),
    attention=Attention("causal", sliding_window="sliding_window"),
    head=CausalLMHead(),
    models=("Phi3ForCausalLM",),
    tiny_config={**TINY_DECODER, "sliding_window": 4},
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one Phi3 model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
