"""Cohere 2 (Command R7B / A): Cohere's parallel block and interleaved RoPE, with sliding
layers that use RoPE and full layers that use none; tied head, logits × ``logit_scale``.

>>> from opake.models import cohere2
>>> cohere2.SPEC.layer
'Cohere2DecoderLayer'
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
    name="cohere2",
    model_types=("cohere2",),
    layer="Cohere2DecoderLayer",
    mlp=Mlp("swiglu", "Cohere2MLP"),
    norm=Norm("layer", "Cohere2LayerNorm", "parallel"),
    rope=Rope("interleaved", "Cohere2RotaryEmbedding", skip="full_attention"),
    attention=Attention("causal", sliding_window="sliding_window", layer_types=True),
    head=CausalLMHead(tied=True, logit_scale="logit_scale"),
    models=("Cohere2ForCausalLM",),
    tiny_config={
        **TINY_DECODER,
        "logit_scale": 0.5,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
    },
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one Cohere 2 model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
