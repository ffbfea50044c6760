"""Qwen 3: Qwen 2 plus per-head RMSNorm on queries and keys.

>>> from opake.models import qwen3
>>> qwen3.SPEC.layer
'Qwen3DecoderLayer'
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
    name="qwen3",
    model_types=("qwen3",),
    layer="Qwen3DecoderLayer",
    mlp=Mlp("swiglu", "Qwen3MLP"),
    norm=Norm("rms", "Qwen3RMSNorm", "pre"),
    rope=Rope("rotate_half", "Qwen3RotaryEmbedding"),
    attention=Attention("causal", sliding_window="sliding_window", layer_types=True, qk_norm=True),
    head=CausalLMHead(),
    models=("Qwen3ForCausalLM",),
    tiny_config={
        **TINY_DECODER,
        "head_dim": 8,
        "use_sliding_window": True,
        "sliding_window": 4,
        "max_window_layers": 1,
    },
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one Qwen3 model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
