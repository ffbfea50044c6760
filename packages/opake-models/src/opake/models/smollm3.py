"""SmolLM 3: Llama's block with RoPE left out of every fourth layer (NoPE), optional sliding
window, tied head.

>>> from opake.models import smollm3
>>> smollm3.SPEC.layer
'SmolLM3DecoderLayer'
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
    name="smollm3",
    model_types=("smollm3",),
    layer="SmolLM3DecoderLayer",
    mlp=Mlp("swiglu", "SmolLM3MLP"),
    norm=Norm("rms", "SmolLM3RMSNorm", "pre"),
    rope=Rope("rotate_half", "SmolLM3RotaryEmbedding", skip="no_rope_layers"),
    attention=Attention("causal", sliding_window="sliding_window", layer_types=True),
    head=CausalLMHead(tied=True),
    models=("SmolLM3ForCausalLM",),
    tiny_config={
        **TINY_DECODER,
        "no_rope_layers": [1, 0],
        "use_sliding_window": True,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
    },
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one SmolLM 3 model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
