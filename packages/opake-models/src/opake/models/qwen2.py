"""Qwen 2: Llama's shape with q/k/v biases; sliding-window layers above ``max_window_layers``.

>>> from opake.models import qwen2
>>> qwen2.SPEC.layer
'Qwen2DecoderLayer'
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
    name="qwen2",
    model_types=("qwen2",),
    layer="Qwen2DecoderLayer",
    mlp=Mlp("swiglu", "Qwen2MLP"),
    norm=Norm("rms", "Qwen2RMSNorm", "pre"),
    rope=Rope("rotate_half", "Qwen2RotaryEmbedding"),
    attention=Attention("causal", sliding_window="sliding_window", layer_types=True),
    head=CausalLMHead(),
    models=("Qwen2ForCausalLM",),
    tiny_config={
        **TINY_DECODER,
        "use_sliding_window": True,
        "sliding_window": 4,
        "max_window_layers": 1,
    },
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one Qwen2 model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
