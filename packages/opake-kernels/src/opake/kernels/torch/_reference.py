"""Reference implementations in plain PyTorch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["cross_entropy", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back: ``x / rms(x) * weight``.

    >>> import torch
    >>> rms_norm(torch.ones(2, 4), torch.ones(4)).tolist()[0]
    [0.9999995231628418, 0.9999995231628418, 0.9999995231628418, 0.9999995231628418]
    """
    import torch

    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Token cross-entropy in fp32; ``mean`` averages over non-ignored tokens (0 if none).

    >>> import torch
    >>> round(cross_entropy(torch.zeros(2, 4), torch.tensor([1, -100])).item(), 4)
    1.3863
    """
    import torch

    logits = logits.float()
    mask = labels != ignore_index
    safe = torch.where(mask, labels, torch.zeros_like(labels))
    nll = torch.logsumexp(logits, -1) - logits.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    nll = nll * mask
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    if reduction == "mean":
        return nll.sum() / mask.sum().clamp_min(1)
    from opake.core.errors import ConfigurationError

    raise ConfigurationError(f"reduction={reduction!r}: expected 'mean', 'sum' or 'none'.")
