"""Shared tiny-config arguments: the base of every family's ``tiny_config``."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

__all__ = ["TINY_DECODER", "TINY_MOE"]

#: a 2-layer decoder, hidden 32, 4 query heads over 2 key/value heads, vocabulary 128
TINY_DECODER: MappingProxyType[str, Any] = MappingProxyType(
    {
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
)

#: a tiny mixture of experts: 4 experts of width 16, top-2, every config name families use
TINY_MOE: MappingProxyType[str, Any] = MappingProxyType(
    {
        "num_local_experts": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
    }
)
