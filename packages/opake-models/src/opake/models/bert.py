"""BERT for sequence classification: bidirectional attention, LayerNorm after each residual
add, GELU MLP, learned positions, pooled first token into a linear classifier.

>>> from opake.models import bert
>>> bert.SPEC.task
'sequence_classification'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opake.models._apply import FamilyReport, apply_family
from opake.models._spec import Attention, ClassifierHead, FamilySpec, Mlp, Norm, Rope

if TYPE_CHECKING:
    import torch

    from opake.patches import PatchOptions

__all__ = ["SPEC", "apply"]

SPEC = FamilySpec(
    name="bert",
    model_types=("bert",),
    layer="BertLayer",
    mlp=Mlp(
        "gelu", "BertIntermediate", gate=None, up="dense", down=None, act="intermediate_act_fn"
    ),
    norm=Norm("layer", "LayerNorm", "post_residual", eps="eps"),
    rope=Rope("none"),
    attention=Attention("bidirectional"),
    head=ClassifierHead(),
    models=("BertForSequenceClassification",),
    tiny_config={
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "num_labels": 3,
        "pad_token_id": 0,
    },
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one BERT model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
