"""OLMo 3: OLMo 2's norms after each sublayer and QK-norm, with sliding/full layers.

>>> from opake.models import olmo3
>>> olmo3.SPEC.layer
'Olmo3DecoderLayer'
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
    name="olmo3",
    model_types=("olmo3",),
    layer="Olmo3DecoderLayer",
    mlp=Mlp("swiglu", "Olmo3MLP"),
    norm=Norm("rms", "Olmo3RMSNorm", "post"),
    rope=Rope("rotate_half", "Olmo3RotaryEmbedding"),
    attention=Attention("causal", sliding_window="sliding_window", layer_types=True, qk_norm=True),
    head=CausalLMHead(),
    models=("Olmo3ForCausalLM",),
    tiny_config={
        **TINY_DECODER,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
    },
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one OLMo 3 model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
