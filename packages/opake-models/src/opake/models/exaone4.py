"""EXAONE 4: norms after each sublayer, QK-norm, sliding layers with RoPE and full layers
without it (hybrid), untied head.

>>> from opake.models import exaone4
>>> exaone4.SPEC.layer
'Exaone4DecoderLayer'
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
    name="exaone4",
    model_types=("exaone4",),
    layer="Exaone4DecoderLayer",
    mlp=Mlp("swiglu", "Exaone4MLP"),
    norm=Norm("rms", "Exaone4RMSNorm", "post"),
    rope=Rope("rotate_half", "Exaone4RotaryEmbedding", skip="full_attention"),
    attention=Attention("causal", sliding_window="sliding_window", layer_types=True, qk_norm=True),
    head=CausalLMHead(),
    models=("Exaone4ForCausalLM",),
    tiny_config={
        **TINY_DECODER,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
    },
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one EXAONE 4 model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
