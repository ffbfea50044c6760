"""Hugging Face compatibility components that model families compose.

Everything here patches one model *instance* (never a class) and records its undo in a
:class:`~opake.patches.Patcher`:

* :func:`additive_attention_mask` / :func:`install_mask_conversion` — 2-D padding masks become
  4-D float additive masks (0 = attend, ``finfo.min`` = masked), which ``vmap`` accepts;
* :func:`disable_kv_cache` — no KV cache inside transforms;
* :func:`route_gradient_checkpointing` — HF gradient checkpointing through the vmap-safe,
  non-reentrant path;
* :func:`dropout_status` — active dropout (needs ``randomness="different"`` under ``vmap``);
* :class:`LossOnlyHead` / :func:`install_loss_only` / :func:`per_example_lm_loss` — the
  ``loss_only=True`` forward computing the loss with the ``linear_cross_entropy`` kernel;
* :func:`install_unbatched_calls` — a one-example call without its batch dimension (1-D
  ``input_ids``, as under ``vmap``) runs as a batch of one and returns unbatched outputs.

>>> import torch
>>> from opake.patches.hf import additive_attention_mask
>>> additive_attention_mask(torch.ones(1, 2), dtype=torch.float32, causal=False).tolist()
[[[[0.0, 0.0], [0.0, 0.0]]]]
"""

from __future__ import annotations

from opake.patches.hf._compat import (
    checkpoint_non_reentrant,
    disable_kv_cache,
    dropout_status,
    route_gradient_checkpointing,
)
from opake.patches.hf._loss_only import (
    LossKernel,
    LossOnlyHead,
    install_loss_only,
    per_example_lm_loss,
    resolve_path,
)
from opake.patches.hf._mask import ATTENTION_KINDS, additive_attention_mask, install_mask_conversion
from opake.patches.hf._unbatched import (
    BATCHED_OUTPUTS,
    UNBATCHED_RANKS,
    install_unbatched_calls,
    is_unbatched_call,
)

__all__ = [
    "ATTENTION_KINDS",
    "BATCHED_OUTPUTS",
    "UNBATCHED_RANKS",
    "LossKernel",
    "LossOnlyHead",
    "additive_attention_mask",
    "checkpoint_non_reentrant",
    "disable_kv_cache",
    "dropout_status",
    "install_loss_only",
    "install_mask_conversion",
    "install_unbatched_calls",
    "is_unbatched_call",
    "per_example_lm_loss",
    "resolve_path",
    "route_gradient_checkpointing",
]
