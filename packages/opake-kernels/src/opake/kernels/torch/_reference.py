"""Reference implementations in plain PyTorch: the oracle every other backend is tested against.

Plain differentiable tensor code (autograd saves whatever it needs), so each op works under
``torch.func`` transforms, including higher-order ones, on every device. They materialise what
the fused backends avoid (the full logits, fp32 copies), so they are the slowest and largest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opake.kernels._args import (
    check_approximate,
    check_ce_tensors,
    check_chunk_size,
    check_lce_tensors,
    check_pointwise_tensors,
    check_rms_norm_args,
    check_rope_tensors,
    loss_spec,
)

if TYPE_CHECKING:
    import torch

__all__ = ["cross_entropy", "geglu", "linear_cross_entropy", "rms_norm", "rope", "swiglu"]


def _ce(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int,
    reduction: str,
    logit_scale: float | None,
    logit_divisor: float | None,
    softcap: float | None,
    label_smoothing: float,
) -> torch.Tensor:
    import torch

    spec = loss_spec(
        tuple(labels.shape),
        ignore_index=ignore_index,
        reduction=reduction,
        logit_scale=logit_scale,
        logit_divisor=logit_divisor,
        softcap=softcap,
        label_smoothing=label_smoothing,
    )
    z = logits.float()
    if logit_scale is not None:
        z = z * float(logit_scale)
    if logit_divisor is not None:
        z = z / float(logit_divisor)
    if softcap is not None:
        z = torch.tanh(z / float(softcap)) * float(softcap)
    mask = labels != ignore_index
    safe = torch.where(mask, labels, torch.zeros_like(labels))
    eps = spec.smoothing
    tok = torch.logsumexp(z, -1) - (1.0 - eps) * z.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    if eps:
        tok = tok - eps * z.mean(-1)
    tok = torch.where(mask, tok, torch.zeros_like(tok))
    if reduction == "none":
        return tok
    if reduction == "sum":
        return tok.sum()
    if reduction == "mean":
        return tok.sum() / mask.sum().clamp_min(1)
    # per_example: each example's mean over its own non-ignored tokens
    return tok.flatten(1).sum(1) / mask.flatten(1).sum(1).clamp_min(1)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    logit_scale: float | None = None,
    logit_divisor: float | None = None,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    chunk_size: bool | int = True,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T + bias``, computed the obvious way (full logits).

    ``chunk_size`` is accepted for a uniform signature and ignored (nothing is tiled here).

    >>> import torch
    >>> h, w = torch.zeros(3, 4), torch.zeros(5, 4)
    >>> round(linear_cross_entropy(h, w, torch.tensor([0, 1, -100])).item(), 4)  # log(5)
    1.6094
    """
    import torch.nn.functional as F

    hidden, weight, labels, bias = check_lce_tensors(hidden, weight, labels, bias)
    check_chunk_size(chunk_size)
    return _ce(
        F.linear(hidden, weight, bias),
        labels,
        ignore_index=ignore_index,
        reduction=reduction,
        logit_scale=logit_scale,
        logit_divisor=logit_divisor,
        softcap=softcap,
        label_smoothing=label_smoothing,
    )


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    logit_scale: float | None = None,
    logit_divisor: float | None = None,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Token cross-entropy in fp32; ``mean`` averages over non-ignored tokens (0 if none).

    >>> import torch
    >>> round(cross_entropy(torch.zeros(2, 4), torch.tensor([1, -100])).item(), 4)
    1.3863
    """
    logits, labels = check_ce_tensors(logits, labels)
    return _ce(
        logits,
        labels,
        ignore_index=ignore_index,
        reduction=reduction,
        logit_scale=logit_scale,
        logit_divisor=logit_divisor,
        softcap=softcap,
        label_smoothing=label_smoothing,
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, *, eps: float = 1e-6, offset: float = 0.0
) -> torch.Tensor:
    """RMSNorm in fp32, cast back to ``x.dtype``: ``x / rms(x) * (offset + weight)``.

    ``offset=1.0`` gives Gemma's ``(1 + weight)`` form; ``weight=None`` normalises only.

    >>> import torch
    >>> rms_norm(torch.ones(2, 4), torch.ones(4)).tolist()[0]
    [0.9999995231628418, 0.9999995231628418, 0.9999995231628418, 0.9999995231628418]
    """
    import torch

    check_rms_norm_args(x, weight, eps, offset)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.float() + offset)
    return y.to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in fp32, cast back (the Llama MLP's gated activation).

    >>> import torch
    >>> swiglu(torch.zeros(2), torch.ones(2)).tolist()
    [0.0, 0.0]
    """
    import torch.nn.functional as F

    check_pointwise_tensors(gate, up)
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def geglu(gate: torch.Tensor, up: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    """``gelu(gate) * up`` in fp32, cast back; ``approximate="tanh"`` for Gemma's GELU.

    >>> import torch
    >>> geglu(torch.zeros(2), torch.ones(2), approximate="tanh").tolist()
    [0.0, 0.0]
    """
    import torch.nn.functional as F

    check_pointwise_tensors(gate, up)
    check_approximate(approximate)
    return (F.gelu(gate.float(), approximate=approximate) * up.float()).to(gate.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding ``x·cos + rotate_half(x)·sin`` (Hugging Face / NeoX layout), in fp32.

    ``cos``/``sin`` broadcast to ``x`` (e.g. ``(batch, 1, seq, head_dim)`` for ``x`` of shape
    ``(batch, heads, seq, head_dim)``).

    >>> import torch
    >>> rope(torch.ones(1, 2), torch.ones(1, 2), torch.zeros(1, 2)).tolist()
    [[1.0, 1.0]]
    """
    import torch

    check_rope_tensors(x, cos, sin)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos.float() + rotated * sin.float()).to(x.dtype)
