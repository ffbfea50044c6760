"""The per-example auxiliary (load-balancing) loss of mixture-of-experts families.

transformers' load-balancing loss averages routing statistics over every token of the batch,
which mixes examples. Here each example's statistics are over its own non-padding tokens
(exactly what transformers computes for a batch of one): the loss-only forward adds
``router_aux_loss_coef ×`` it to that example's loss, and the logits path reports their mean.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from opake.core.errors import OperationError

if TYPE_CHECKING:
    import torch

    from opake.patches import Patcher

__all__ = [
    "COLLECT",
    "example_aux_loss",
    "install_aux_logits_path",
    "padding_of",
    "per_example_load_balancing",
]

#: router logits ``[B, T, E]`` of every MoE block run while a per-example aux loss is collected
COLLECT: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar(
    "opake_moe_router_logits", default=None
)


def padding_of(mask: torch.Tensor | None, batch: int, steps: int, device: Any) -> torch.Tensor:
    """``[B, T]`` float, 1 for real tokens: from a 2-D mask, or the diagonal of a 4-D additive
    mask (a token attends to itself exactly when it is not padding).

    >>> import torch
    >>> from opake.patches.hf import additive_attention_mask
    >>> m = torch.tensor([[1, 1, 0], [0, 1, 1]])
    >>> padding_of(additive_attention_mask(m, dtype=torch.float32, causal=True), 2, 3, "cpu")
    tensor([[1., 1., 0.],
            [0., 1., 1.]])
    """
    import torch

    if mask is None:
        return torch.ones(batch, steps, device=device)
    if mask.dim() == 2:
        return (mask != 0).float()
    if mask.dim() == 4:
        diag = mask[:, 0].diagonal(dim1=-2, dim2=-1)[..., -steps:]
        if mask.is_floating_point():
            return (diag > torch.finfo(mask.dtype).min / 2).float()
        return diag.float()
    raise OperationError(f"attention_mask of shape {tuple(mask.shape)}: expected 2-D or 4-D.")


def per_example_load_balancing(
    logits: list[torch.Tensor], real: torch.Tensor, experts: int, top_k: int
) -> torch.Tensor:
    """transformers' load-balancing loss of each example alone ``[B]``: ``E · Σ_e f_e P_e``
    with ``f_e`` the fraction of the example's (layer, token) top-k slots routed to ``e`` and
    ``P_e`` its mean router probability, over its real tokens only.

    >>> import torch
    >>> uniform = [torch.zeros(2, 3, 4)]  # every token picks expert 0 (ties), P_e = 1/4
    >>> per_example_load_balancing(uniform, torch.ones(2, 3), experts=4, top_k=1).tolist()
    [1.0, 1.0]
    """
    import torch

    counts = torch.zeros(real.shape[0], experts, device=real.device)
    probs = torch.zeros(real.shape[0], experts, device=real.device)
    arange = torch.arange(experts, device=real.device)
    for layer in logits:
        p = torch.softmax(layer, dim=-1)
        index = torch.topk(p, top_k, dim=-1).indices
        hits = (index[..., None] == arange).float().sum(dim=-2)  # [B, T, E]
        counts = counts + (hits * real[..., None]).sum(dim=1)
        probs = probs + (p.float() * real[..., None]).sum(dim=1)
    rows = (real.sum(dim=1) * len(logits)).clamp_min(1.0)[:, None]
    return experts * ((counts / rows) * (probs / rows)).sum(dim=1)


def example_aux_loss(
    model: Any, arguments: dict[str, Any]
) -> contextlib.AbstractContextManager[Callable[[], torch.Tensor | None] | None]:
    """The loss-only forward's per-example auxiliary loss (a ``LossOnlyHead.aux_loss``).

    Reads ``output_router_logits`` (the call's, else the config's); when on, transformers'
    batch-wide capture is turned off for the backbone call and the router logits of every MoE
    block are collected instead; the yielded function returns
    ``router_aux_loss_coef × per_example_load_balancing`` ``[B]``.
    """
    flag = arguments.pop("output_router_logits", None)
    if flag is None:
        flag = bool(getattr(model.config, "output_router_logits", False))
    if not flag:
        return contextlib.nullcontext(None)
    arguments["output_router_logits"] = False
    return _weighted(model, arguments.get("attention_mask"))


def _coef(model: Any) -> float:
    return float(getattr(model, "router_aux_loss_coef", model.config.router_aux_loss_coef))


@contextlib.contextmanager
def _weighted(model: Any, mask: Any) -> Iterator[Callable[[], torch.Tensor | None]]:
    """:func:`_collecting`, yielding ``router_aux_loss_coef ×`` the per-example losses."""
    coef = _coef(model)
    with _collecting(model, mask) as raw:

        def weighted() -> torch.Tensor | None:
            losses = raw()
            return None if losses is None else coef * losses

        yield weighted


@contextlib.contextmanager
def _collecting(model: Any, mask: Any) -> Iterator[Callable[[], torch.Tensor | None]]:
    """Collect the router logits of every MoE block run inside; yields a function returning
    each example's load-balancing loss ``[B]`` (None when no block ran)."""
    collected: list[torch.Tensor] = []
    token = COLLECT.set(collected)

    def losses() -> torch.Tensor | None:
        if not collected:
            return None
        batch, steps = collected[0].shape[:2]
        real = padding_of(mask, batch, steps, collected[0].device)
        experts = int(getattr(model, "num_experts", collected[0].shape[-1]))
        top_k = int(getattr(model, "num_experts_per_tok", model.config.num_experts_per_tok))
        return per_example_load_balancing(collected, real, experts, top_k)

    try:
        yield losses
    finally:
        COLLECT.reset(token)


def install_aux_logits_path(model: Any, patcher: Patcher) -> None:
    """Make the logits path's auxiliary loss per example too (this instance's ``forward``).

    With ``output_router_logits`` on, transformers pools routing statistics over the batch (and
    reads a 2-D mask only). The wrapped forward turns that capture off, collects the router
    logits itself and reports ``aux_loss`` = the mean over examples of each example's own
    load-balancing loss (for one example: transformers' value), added to ``loss`` with
    ``router_aux_loss_coef`` when labels are given; ``router_logits`` holds the collected
    ``[B·T, E]`` logits per layer.
    """
    import functools
    import inspect

    inner = model.forward
    try:
        names = list(inspect.signature(inner).parameters)
    except (TypeError, ValueError):  # pragma: no cover - exotic forwards
        names = []

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> object:
        arguments = {**dict(zip(names, args, strict=False)), **kwargs}
        flag = arguments.get("output_router_logits")
        if flag is None:
            flag = bool(getattr(model.config, "output_router_logits", False))
        if not flag:
            return inner(*args, **kwargs)
        kwargs["output_router_logits"] = False
        with _collecting(model, arguments.get("attention_mask")) as losses:
            out = inner(*args, **kwargs)
            per_example = losses()
        if per_example is None:
            return out
        coef = _coef(model)
        aux = per_example.mean()
        if getattr(out, "loss", None) is not None:
            out["loss"] = out.loss + coef * aux.to(out.loss.dtype)
        out["aux_loss"] = aux
        return out

    # mark the wrapper (through vars(): a function's type declares no such attribute)
    vars(forward)["_opake_stage"] = "moe_aux_loss"
    patcher.set_attr(model, "forward", forward)
