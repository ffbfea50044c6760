"""Mixture-of-experts blocks under DP: per-example routing with no data-dependent shapes.

transformers' expert modules loop over the experts that received tokens (``nonzero``,
``torch.where``): data-dependent shapes that ``vmap`` cannot batch, and token indices over the
*flattened* batch that the book-keeping engine cannot attribute to examples. The adapter
replaces, on each instance:

* the **block** forward — batch-first throughout: the router runs on the flattened tokens (the
  family's own router, so routing is the family's), then the experts are called with
  ``[B, T, H]`` hidden states and ``[B, T, k]`` routing, so every hooked layer sees the batch on
  dimension 0;
* the **experts** forward — under ``vmap`` a dense dispatch: every expert runs on every token of
  the example and the outputs are combined with a dense ``[T, E]`` routing-weight matrix that is
  zero outside each token's top-k (the same function, no data-dependent shape, per-example
  gradients exact: an expert a token was not routed to contributes exactly zero). Outside
  ``vmap`` (plain autograd, the book-keeping engine's batched forward) the family's own sparse
  code runs on the flattened tokens.

Book-keeping: while the engine records, the block runs its experts with
:func:`opake.models.bookkeeping.recorded_experts` (sparse, each expert on its own tokens, the
output tapped): each fused ``[E, ...]`` weight's per-example gradients are an
:class:`~opake.models.bookkeeping.ExpertGrads` (ghost norms over each example's tokens routed
to each expert), not the per-layer ``vmap`` fallback. The router's logits
are tapped (:func:`opake.dpsgd.bookkeeping.implicit_use`) and its per-example gradient is
``Σ_t g_t ⊗ x_t`` over the example's tokens; the weights are recomputed from the tapped logits
with the spec's :data:`~opake.models.ROUTINGS` rule.

Auxiliary loss: transformers' load-balancing loss averages routing statistics over every token
of the batch, which mixes examples. The loss-only forward computes it **per example** (each
example's statistics over its own non-padding tokens; exactly what transformers computes for a
batch of one) and adds ``router_aux_loss_coef ×`` it to that example's loss.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, OperationError
from opake.models._experts import fused_experts
from opake.models._moe_aux import (
    COLLECT,
    example_aux_loss,
    install_aux_logits_path,
    padding_of,
    per_example_load_balancing,
)

if TYPE_CHECKING:
    import torch

    from opake.models._spec import Moe
    from opake.patches import Patcher

__all__ = [
    "dense_experts",
    "example_aux_loss",
    "install_aux_logits_path",
    "install_moe",
    "padding_of",
    "per_example_load_balancing",
    "routing_weights",
]

_MARK = "_opake_moe"


def _in_vmap(x: torch.Tensor) -> bool:
    """True when ``x`` is batched by ``vmap`` (under any ``grad`` wrappers)."""
    import torch

    functorch = torch._C._functorch
    t = x
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            return True
        t = functorch.get_unwrapped(t)
    return False


def _proj(
    x: torch.Tensor, weight: torch.Tensor, transposed: bool, *, per_expert: bool
) -> torch.Tensor:
    """``x [..., in]`` (every expert sees it) or ``[..., E, in]`` (``per_expert``) through
    every expert's ``weight`` → ``[..., E, out]``."""
    import torch

    lhs = "...ei" if per_expert else "...i"
    if transposed:  # weight [E, in, out]
        return torch.einsum(f"{lhs},eio->...eo", x, weight)
    return torch.einsum(f"{lhs},eoi->...eo", x, weight)  # weight [E, out, in]


def dense_experts(
    module: torch.nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Every expert on every token, combined by the top-k weights (zero elsewhere).

    ``x`` is ``[..., H]``, ``index`` and ``weights`` ``[..., k]``. ``module`` is a transformers
    experts module (``use_experts_implementation``): its ``gate_up_proj`` / ``up_proj``,
    ``down_proj``, optional biases, ``is_transposed``, ``_apply_gate`` (or ``act_fn``) and
    optional ``post_expert_norm`` define each expert, exactly as its own code uses them. An
    index outside ``[0, E)`` (an expert-parallel sentinel) selects nothing.

    >>> import torch
    >>> from transformers import MixtralConfig
    >>> from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    >>> cfg = MixtralConfig(hidden_size=4, intermediate_size=6, num_local_experts=3)
    >>> experts = MixtralExperts(cfg)
    >>> for p in experts.parameters():
    ...     _ = torch.nn.init.normal_(p)
    >>> x, idx, w = torch.randn(5, 4), torch.tensor([[0, 2]] * 5), torch.full((5, 2), 0.5)
    >>> torch.allclose(dense_experts(experts, x, idx, w), experts(x, idx, w), atol=1e-5)
    True
    """
    import torch

    fused = fused_experts(module)
    experts = int(fused.num_experts)
    transposed = bool(getattr(module, "is_transposed", False))
    gated = bool(getattr(module, "has_gate", True))
    bias = bool(getattr(module, "has_bias", False))
    first = "gate_up_proj" if gated else "up_proj"
    h = _proj(x, getattr(module, first), transposed, per_expert=False)
    if bias:
        h = h + getattr(module, f"{first}_bias")
    h = fused._apply_gate(h) if gated else fused.act_fn(h)
    out = _proj(h, fused.down_proj, transposed, per_expert=True)
    if bias:
        out = out + fused.down_proj_bias
    if getattr(module, "has_post_expert_norm", False):
        out = fused.post_expert_norm(out)
    hit = index[..., None] == torch.arange(experts, device=index.device)  # [..., k, E]
    dense = (hit.to(weights.dtype) * weights[..., None]).sum(dim=-2)  # [..., E]
    combined = torch.einsum("...e,...eh->...h", dense.to(out.dtype), out)
    return combined.to(x.dtype)


def _experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Batch-first experts: dense under ``vmap``, the family's own code otherwise."""
    if _in_vmap(hidden_states):
        return dense_experts(module, hidden_states, top_k_index, top_k_weights)
    size = hidden_states.shape[-1]
    k = top_k_index.shape[-1]
    stock = type(module).forward
    out: torch.Tensor = stock(
        module,
        hidden_states.reshape(-1, size),
        top_k_index.reshape(-1, k),
        top_k_weights.reshape(-1, k),
    )
    return out.reshape(hidden_states.shape)


def routing_weights(
    logits: torch.Tensor, routing: str, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, index)`` ``[..., k]`` from router logits, as the family's router computes them.

    >>> import torch
    >>> w, i = routing_weights(torch.tensor([[0.0, 1.0, 2.0]]), "softmax_topk", 2, True)
    >>> i.tolist(), round(float(w.sum()), 6)
    ([[2, 1]], 1.0)
    """
    import torch

    if routing == "softmax_topk":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, index = torch.topk(probs, top_k, dim=-1)
        if normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), index
    if routing == "topk_softmax":
        top, index = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), index
    raise OperationError(
        f"book-keeping: routing {routing!r} cannot be recomputed from tapped router logits; "
        "use clipped_grad(engine='vmap') for this family"
    )


@dataclass(frozen=True)
class _Router:
    """How one block's router is run (read once from the spec and the config)."""

    spec: Moe
    top_k: int
    normalize: bool

    def __call__(
        self, block: torch.nn.Module, x: torch.Tensor, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """``(logits [B, T, E], weights [B, T, k], index [B, T, k])`` for ``x [B, T, H]``."""
        import torch
        import torch.nn.functional as F

        from opake.dpsgd.bookkeeping import implicit_use

        batch, steps, size = x.shape
        router = getattr(block, self.spec.router)
        if self.spec.router_linear is not None:
            linear = getattr(router, self.spec.router_linear)
            xin = x.float() if linear.weight.dtype == torch.float32 else x
            logits = linear(xin)
            weights, index = routing_weights(logits, self.spec.routing, self.top_k, self.normalize)
            return logits, weights, index
        use = implicit_use(router)
        hashed = self.spec.router_input_ids is not None and getattr(
            block, self.spec.router_input_ids, False
        )
        if use is None:
            extra = (input_ids,) if hashed else ()
            logits, weights, index = router(x.reshape(-1, size), *extra)
            shape = (batch, steps, -1)
            return logits.reshape(shape), weights.reshape(shape), index.reshape(shape)
        if _hf_collects_router_logits():
            raise OperationError(
                "book-keeping: output_router_logits is on in a batched forward; transformers' "
                "load-balancing loss averages routing over the whole batch and mixes examples. "
                "Use the loss-only forward (loss_only=True, per_example_loss=True), which adds "
                "each example's own auxiliary loss, or output_router_logits=False"
            )
        weight = use.params["weight"].detach()
        bias = use.params.get("bias")
        logits = F.linear(x, weight, None if bias is None else bias.detach())
        attrs = tuple(use.params)

        def build(grad: torch.Tensor) -> dict[str, torch.Tensor]:
            out = {"weight": torch.einsum("bte,bth->beh", grad.float(), x.detach().float())}
            if "bias" in attrs:
                out["bias"] = grad.float().sum(dim=1)
            return out

        logits = use.tap(logits, build)
        weights, index = routing_weights(logits, self.spec.routing, self.top_k, self.normalize)
        return logits, weights, index


def _hf_collects_router_logits() -> bool:
    """Whether transformers' output capture is collecting router logits right now."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - other transformers layouts
        return False
    get: Callable[[], object] = _active_collector.get  # unannotated there: its type, stated
    collected = get()
    return isinstance(collected, dict) and "router_logits" in collected


def _block_forward(router: _Router) -> Callable[..., object]:
    spec = router.spec

    def forward(
        block: torch.nn.Module,
        hidden_states: torch.Tensor,
        *args: Any,
        input_ids: torch.Tensor | None = None,
        **kw: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The block's output, with the routing scores where the family's block returns them."""
        import torch

        if args or kw or (input_ids is not None and spec.router_input_ids is None):
            given = sorted(kw) + (["input_ids"] if input_ids is not None else [])
            raise OperationError(
                f"{type(block).__name__}: the DP forward takes the hidden states only; got "
                f"{len(args)} more positional and {given} keyword argument(s)"
            )
        x = hidden_states
        noise = float(getattr(block, "jitter_noise", 0.0) or 0.0) if spec.jitter else 0.0
        if block.training and noise > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - noise, 1.0 + noise)
        logits, weights, index = router(block, x, input_ids)
        collected = COLLECT.get()
        if collected is not None:
            collected.append(logits)
        out = _run_experts(getattr(block, spec.experts), x, index, weights)
        if spec.shared is not None:
            shared = getattr(block, spec.shared)(x)
            if spec.shared_gate is not None:
                shared = torch.sigmoid(getattr(block, spec.shared_gate)(x)) * shared
            out = out + shared
        if spec.returns_scores:
            return out, weights.reshape(-1, weights.shape[-1])
        return out

    return forward


def _run_experts(
    experts: torch.nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The experts on ``x [B, T, H]``; while the book-keeping engine records, its native rule
    (:func:`opake.models.bookkeeping.recorded_experts`) instead of the per-layer fallback."""
    from opake.dpsgd.bookkeeping import implicit_use
    from opake.models.bookkeeping import recorded_experts, supports_recording

    if supports_recording(experts):
        use = implicit_use(experts)
        if use is not None:
            return recorded_experts(experts, use, x, index, weights)
    out: torch.Tensor = experts(x, index, weights)
    return out


def _normalize(spec: Moe, config: Any) -> bool:
    if isinstance(spec.normalize, bool):
        return spec.normalize
    value = getattr(config, spec.normalize, None)
    if not isinstance(value, bool):
        raise ConfigurationError(
            f"config.{spec.normalize}={value!r}: expected True or False (whether the top-k "
            "routing weights are renormalised)."
        )
    return value


def install_moe(model: torch.nn.Module, spec: Moe, patcher: Patcher) -> int:
    """Give every ``spec.block`` of ``model`` the DP forward; returns how many were patched."""
    import torch

    from opake.models._swaps import modules_of_class

    blocks = list(modules_of_class(model, spec.block))
    config = model.config
    for block in blocks:
        experts = getattr(block, spec.experts, None)
        router = getattr(block, spec.router, None)
        missing = [
            name
            for name, obj in ((spec.experts, experts), (spec.router, router))
            if not isinstance(obj, torch.nn.Module)
        ]
        if missing or not hasattr(experts, "down_proj") or not hasattr(experts, "num_experts"):
            raise ConfigurationError(
                f"{type(block).__name__} has no {missing or 'fused experts'} as the adapter "
                "expects (experts with [E, ...] tensors and a router): this transformers version "
                "changed the MoE block. Update the adapter."
            )
        top_k = int(getattr(router, "top_k", 0) or getattr(config, "num_experts_per_tok", 0))
        state = _Router(spec, top_k, _normalize(spec, config))
        patcher.set_attr(block, "forward", types.MethodType(_block_forward(state), block))
        patcher.set_attr(experts, "forward", types.MethodType(_experts_forward, experts))
        patcher.set_attr(block, _MARK, True)
    return len(blocks)
