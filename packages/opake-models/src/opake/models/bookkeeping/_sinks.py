"""The ``attention_sinks`` book-keeping rule: GPT-OSS's learned per-head attention sinks.

A sink is one more logit per head and query, ``s_h``, in the softmax over the keys (its
probability is dropped). Softmax is shift invariant, so adding ``δ`` to the sink logit is the
same as subtracting ``δ`` from every key logit — from the additive attention mask. The patched
attention (:func:`install_sinks`) therefore runs, while the book-keeping engine records, with the
mask minus a tapped zero ``δ [B, H, 1, 1]`` (one per example and head): the gradient that
reaches ``δ`` is each example's gradient of the sinks, ``[B, H]``, exactly, from the one
batched backward. Nothing is recomputed; the rest of the attention is transformers' own code.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opake.core.errors import OperationError
from opake.core.plugins import BookkeepingRule

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping.rules import LayerUse, Piece, RuleExample
    from opake.patches import Patcher

__all__ = ["CLASSES", "RULE", "install_sinks"]

#: attention classes whose eager attention adds a learned ``sinks [heads]`` logit
CLASSES = ("GptOssAttention",)
_MARK = "_opake_sinks_patched"


def _sinks_forward(original: Callable[..., object]) -> Callable[..., object]:
    def forward(
        self: torch.nn.Module,
        hidden_states: torch.Tensor,
        position_embeddings: Any = None,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> object:
        from opake.dpsgd.bookkeeping import implicit_use

        use = implicit_use(self)
        if use is None:
            return original(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        if getattr(self.config, "_attn_implementation", None) != "eager":
            raise OperationError(
                "book-keeping: trained attention sinks need attn_implementation='eager' (the "
                "sinks' per-example gradients come from the additive mask); load the model "
                "with it, freeze the sinks, or use clipped_grad(engine='vmap')"
            )
        if attention_mask is not None and not attention_mask.is_floating_point():
            raise OperationError(
                f"book-keeping: trained attention sinks need an additive float attention mask, "
                f"got {attention_mask.dtype}; use clipped_grad(engine='vmap')"
            )
        sinks = use.params["sinks"]
        dtype = attention_mask.dtype if attention_mask is not None else hidden_states.dtype
        zero = hidden_states.new_zeros(hidden_states.shape[0], sinks.shape[0], 1, 1, dtype=dtype)

        def build(grad: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"sinks": grad.reshape(grad.shape[0], -1).float()}

        delta = use.tap(zero, build, inside=True)
        mask = -delta if attention_mask is None else attention_mask - delta
        return original(hidden_states, position_embeddings, mask, *args, **kwargs)

    return forward


def install_sinks(model: torch.nn.Module, patcher: Patcher) -> int:
    """Give every attention module of :data:`CLASSES` the recording forward; returns how many."""
    from opake.models._swaps import modules_of_class

    count = 0
    for name in CLASSES:
        for module in modules_of_class(model, name):
            forward = types.MethodType(_sinks_forward(module.forward), module)
            patcher.set_attr(module, "forward", forward)
            patcher.set_attr(module, _MARK, True)
            count += 1
    return count


def matches(module: torch.nn.Module, attrs: frozenset[str]) -> bool | str:
    """A patched attention module with sinks (only the sinks: its projections are linears)."""
    if type(module).__name__ not in CLASSES or attrs != {"sinks"}:
        return False
    if not getattr(module, _MARK, False):
        return (
            f"{type(module).__name__}'s sinks are book-kept by the patched attention: patch the "
            "model with opake.patches.apply_model_patches"
        )
    return True


def pieces(use: LayerUse) -> dict[str, Piece]:
    """Never reached: the patched forward records the sinks itself (``tap(inside=True)``)."""
    raise use.fail("the attention ran without its patched forward; apply_model_patches first")


def example() -> RuleExample:
    """A GPT-OSS attention (2 heads, head size 4, eager) over ``tanh`` of the inputs, causal."""
    import torch
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention

    from opake.dpsgd.bookkeeping.rules import RuleExample
    from opake.patches import Patcher

    config = GptOssConfig(
        hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_hidden_layers=1
    )
    config._attn_implementation = "eager"

    class SinkAttention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = GptOssAttention(config, layer_idx=0)
            with torch.no_grad():
                self.attn.sinks.normal_(generator=torch.Generator().manual_seed(0))
            install_sinks(self, Patcher())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            steps = x.shape[1]
            cos = torch.ones(1, steps, 2, dtype=x.dtype)  # GPT-OSS: half the head size
            sin = torch.zeros(1, steps, 2, dtype=x.dtype)
            causal = torch.ones(steps, steps, dtype=torch.bool).tril()
            mask = torch.zeros(steps, steps, dtype=x.dtype).masked_fill(~causal, -1e9)
            out: torch.Tensor
            out, _ = self.attn(torch.tanh(x), (cos, sin), mask[None, None])
            return out

    return RuleExample(SinkAttention(), width=8)


RULE = BookkeepingRule(
    "attention_sinks",
    matches=matches,
    pieces=pieces,
    produces={"sinks": "dense"},
    example=example,
)
