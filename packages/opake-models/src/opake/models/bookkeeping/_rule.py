"""The ``fused_experts`` book-keeping rule: transformers' fused expert modules, called batch-first.

Matches an experts module holding ``[E, ...]`` projection tensors (``gate_up_proj`` or
``up_proj``, ``down_proj``, optional biases; transformers' ``use_experts_implementation``
classes). Two ways in:

- the patched MoE block (:mod:`opake.models._moe`) runs the experts with
  :func:`~opake.models.bookkeeping.recorded_experts` while the engine records — the fast way,
  nothing computed twice;
- any other batch-first call ``experts(x [B, T, H], index [B, T, k], weights [B, T, k])`` is
  recorded by the engine's hook and :func:`pieces` recomputes the experts' intermediate
  activations from its inputs (one more forward of the experts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opake.core.plugins import BookkeepingRule
from opake.models.bookkeeping._record import experts_forward, supports_recording

if TYPE_CHECKING:
    import torch

    from opake.dpsgd.bookkeeping.rules import LayerUse, Piece, RuleExample

__all__ = ["RULE", "example", "matches", "pieces"]

#: the attributes the rule handles (weights: implicit pieces; biases: dense)
WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
BIASES = ("gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


def matches(module: torch.nn.Module, attrs: frozenset[str]) -> bool:
    """A fused experts module (``[E, ...]`` tensors, no post-expert norm)."""
    return supports_recording(module) and attrs <= set(WEIGHTS + BIASES)


def _inputs(use: LayerUse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import torch

    values = [*use.args, *use.kwargs.values()]
    if len(values) != 3 or not all(isinstance(v, torch.Tensor) for v in values):
        raise use.fail("expected the call experts(hidden_states, top_k_index, top_k_weights)")
    x, index, weights = values
    if x.dim() != 3 or x.shape[0] != use.batch or index.shape != weights.shape:
        raise use.fail(
            f"hidden states of shape {tuple(x.shape)}: the rule needs them batch-first "
            f"[{use.batch}, T, H] (patch the model with opake.patches.apply_model_patches, "
            "whose MoE blocks call their experts that way)"
        )
    return x, index, weights


def pieces(use: LayerUse) -> dict[str, Piece]:
    """Each fused weight's per-example gradients (:class:`ExpertGrads`) and the biases'."""
    import torch

    from opake.dpsgd.bookkeeping.rules import Dense, Implicit

    assert use.grad is not None
    x, index, weights = _inputs(use)
    params = {attr: use.params[attr] for attr in use.attrs}
    with torch.no_grad():
        _, saved = experts_forward(use.module, params, x, index, weights)
        built = saved.build(use.grad)
    return {
        attr: Dense(value) if isinstance(value, torch.Tensor) else Implicit(value)
        for attr, value in built.items()
    }


def _routed(experts: torch.nn.Module, width: int, seed: int) -> torch.nn.Module:
    """``experts`` behind a fixed (not trained) top-2 softmax router, called batch-first
    through the MoE adapter's experts forward (dense under ``vmap``)."""
    import types

    import torch

    from opake.models._experts import fused_experts
    from opake.models._moe import _experts_forward

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    experts.forward = types.MethodType(_experts_forward, experts)
    count = int(fused_experts(experts).num_experts)

    class Routed(torch.nn.Module):
        route: torch.Tensor

        def __init__(self) -> None:
            super().__init__()
            self.experts = experts
            self.register_buffer("route", torch.randn(width, count, generator=gen))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            logits = x @ self.route.to(x.dtype)
            top, index = torch.topk(torch.softmax(logits, dim=-1), 2, dim=-1)
            out: torch.Tensor = self.experts(x, index, top)
            return out

    return Routed()


def example() -> tuple[RuleExample, ...]:
    """transformers' Mixtral experts (``[E, out, in]``, SwiGLU) and GPT-OSS experts
    (``[E, in, out]``, biases, interleaved clamped SwiGLU): 4 experts, top-2, hidden 8."""
    from transformers import GptOssConfig, MixtralConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from opake.dpsgd.bookkeeping.rules import RuleExample

    sizes: dict[str, Any] = {"hidden_size": 8, "intermediate_size": 6, "num_local_experts": 4}
    mixtral, gpt_oss = MixtralConfig(**sizes), GptOssConfig(**sizes)
    for config in (mixtral, gpt_oss):
        config._experts_implementation = "eager"  # fp64 references run the same code
    # transformers leaves GptOssExperts' constructor unannotated: its signature, stated
    gpt_oss_experts: Callable[[GptOssConfig], torch.nn.Module] = GptOssExperts
    modules = (MixtralExperts(mixtral), gpt_oss_experts(gpt_oss))
    return tuple(
        RuleExample(_routed(module, 8, seed), width=8) for seed, module in enumerate(modules)
    )


RULE = BookkeepingRule(
    "fused_experts",
    matches=matches,
    pieces=pieces,
    produces={**dict.fromkeys(WEIGHTS, "implicit"), **dict.fromkeys(BIASES, "dense")},
    example=example,
    broadcast=False,
)
