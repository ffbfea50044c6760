"""GPT-2: GELU (tanh) MLP, LayerNorm before each sublayer, learned positions, tied head.

>>> from opake.models import gpt2
>>> gpt2.SPEC.layer
'GPT2Block'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opake.models._apply import FamilyReport, apply_family
from opake.models._spec import Attention, CausalLMHead, FamilySpec, Mlp, Norm, Rope

if TYPE_CHECKING:
    import torch

    from opake.patches import PatchOptions

__all__ = ["SPEC", "apply"]

SPEC = FamilySpec(
    name="gpt2",
    model_types=("gpt2",),
    layer="GPT2Block",
    mlp=Mlp("gelu", "GPT2MLP", gate=None, up="c_fc", down="c_proj", act="act"),
    norm=Norm("layer", "LayerNorm", "pre", eps="eps"),
    rope=Rope("none"),
    attention=Attention("causal"),
    head=CausalLMHead(backbone="transformer", embedding="transformer.wte", tied=True),
    models=("GPT2LMHeadModel",),
    tiny_config={
        "vocab_size": 128,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 64,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one GPT-2 model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
