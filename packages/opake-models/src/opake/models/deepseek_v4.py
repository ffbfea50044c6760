"""DeepSeek-V4: compressed (CSA/HCA) attention with a sparse indexer, hyper-connections, and a
sparse MoE with shared experts in every layer — hash routing (experts from the token id) in the
first layers, ``sqrtsoftplus`` scores with a bias-corrected top-k in the others.

>>> from opake.models import deepseek_v4
>>> deepseek_v4.SPEC.moe.routing
'family'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opake.models._apply import FamilyReport, apply_family
from opake.models._spec import Attention, CausalLMHead, FamilySpec, Moe, Norm, Rope

if TYPE_CHECKING:
    import torch

    from opake.patches import PatchOptions

__all__ = ["SPEC", "apply"]

SPEC = FamilySpec(
    name="deepseek_v4",
    model_types=("deepseek_v4",),
    layer="DeepseekV4DecoderLayer",
    mlp=None,  # the shared experts clamp their SwiGLU: no kernel computes that
    norm=Norm("rms", "DeepseekV4RMSNorm", "pre"),
    rope=Rope("rotate_half", "DeepseekV4RotaryEmbedding", partial=True),
    # every layer type uses the same sliding-window mask; learned attention sinks
    attention=Attention("causal", sliding_window="sliding_window", sinks=True),
    head=CausalLMHead(),
    models=("DeepseekV4ForCausalLM",),
    tiny_config={
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 16,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "q_lora_rank": 16,
        "o_groups": 2,
        "o_lora_rank": 16,
        "index_n_heads": 2,
        "index_head_dim": 8,
        "index_topk": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "hc_mult": 2,
        "sliding_window": 4,
        "mlp_layer_types": ["hash_moe", "moe"],
        # one layer of each compressed kind, compressing every 2 tokens (seen within 8 tokens)
        "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
        "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 2},
        "num_nextn_predict_layers": 0,
        "max_position_embeddings": 64,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    moe=Moe(
        "DeepseekV4SparseMoeBlock",
        routing="family",
        shared="shared_experts",
        router_input_ids="is_hash",
    ),
    bookkeeping_frozen={
        "_hc.": "the hyper-connections return tuples, which the engine's hooks cannot tap",
        "hc_head.": "the hyper-connections return tuples, which the engine's hooks cannot tap",
        ".mlp.gate.": "family routing (hashed / bias-corrected top-k) is not recomputed from "
        "tapped logits",
        ".sinks": "owned by the attention, which has parameterised children",
        ".position_bias": "owned by the compressor, which has parameterised children",
    },
)


def apply(model: torch.nn.Module, options: PatchOptions) -> FamilyReport:
    """Patch one DeepSeek-V4 model instance (called by ``opake.patches.apply_model_patches``)."""
    return apply_family(SPEC, model, options)
