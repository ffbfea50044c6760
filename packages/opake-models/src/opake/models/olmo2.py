"""OLMo 2: RMSNorm after each sublayer (before the residual add), RMSNorm on full q/k.

>>> from opake.models import olmo2
>>> olmo2.SPEC.layer
'Olmo2DecoderLayer'
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
    name="olmo2",
    model_types=("olmo2",),
    layer="Olmo2DecoderLayer",
    mlp=Mlp("swiglu", "Olmo2MLP"),
    norm=Norm("rms", "Olmo2RMSNorm", "post"),
    rope=Rope("rotate_half", "Olmo2RotaryEmbedding"),
    attention=Attention("causal", qk_norm=True),
    head=CausalLMHead(),
    models=("Olmo2ForCausalLM",),
    tiny_config=dict(TINY_DECODER),
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one Olmo2 model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
