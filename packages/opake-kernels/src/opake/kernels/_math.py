"""Small tensor helpers shared by the backends (plain PyTorch, vmap-safe unless stated)."""

from __future__ import annotations

import torch

from opake.core.errors import ConfigurationError
from opake.kernels._args import LossSpec

__all__ = [
    "check_label_values",
    "reduce_tokens",
    "token_grad",
    "token_loss",
    "transform_grad_",
    "transform_logits_",
]


def transform_logits_(z: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """Apply ``mult`` then the softcap to fp32 logits *z* in place; returns *z*."""
    if spec.mult is not None:
        z.mul_(spec.mult)
    if spec.softcap is not None:
        z.div_(spec.softcap).tanh_().mul_(spec.softcap)
    return z


def transform_grad_(d: torch.Tensor, z: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """Chain ``d`` (gradient w.r.t. transformed logits *z*) back to the raw logits, in place."""
    if spec.softcap is not None:
        t = z / spec.softcap
        d.mul_(t.mul_(t).neg_().add_(1.0))
    if spec.mult is not None:
        d.mul_(spec.mult)
    return d


def token_loss(
    lse: torch.Tensor,
    z_target: torch.Tensor,
    z_sum: torch.Tensor | None,
    vocab: int,
    spec: LossSpec,
) -> torch.Tensor:
    """Per-token loss ``lse - (1-ε)·z_y - ε·mean(z)`` (fp32, before masking)."""
    eps = spec.smoothing
    out = lse - (1.0 - eps) * z_target
    if eps and z_sum is not None:
        out = out - (eps / vocab) * z_sum
    return out


def reduce_tokens(tok: torch.Tensor, labels: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """Reduce masked per-token losses: ``(N,)`` for ``none``, else ``(n_seg,)``."""
    if spec.reduction == "none":
        return tok
    per = tok.shape[0] // spec.n_seg
    sums = tok.reshape(spec.n_seg, per).sum(1)
    if spec.reduction == "sum":
        return sums
    count = (labels != spec.ignore_index).reshape(spec.n_seg, per).sum(1)
    return sums / count.clamp_min(1).to(sums.dtype)


def token_grad(grad_out: torch.Tensor, labels: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """The upstream gradient of each token's loss (fp32, zero on ignored tokens).

    Runs inside ``backward`` where ``vmap`` may batch its inputs: plain tensor ops only.
    """
    mask = labels != spec.ignore_index
    grad_out = grad_out.float()
    if spec.reduction == "none":
        return grad_out * mask
    per = labels.shape[0] // spec.n_seg
    seg_mask = mask.reshape(spec.n_seg, per)
    seg = grad_out
    if spec.reduction == "mean":
        seg = seg / seg_mask.sum(1).clamp_min(1).to(seg.dtype)
    return (seg.unsqueeze(1) * seg_mask).reshape(labels.shape[0])


def check_label_values(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Fail on a label outside ``[0, vocab)`` that is not ``ignore_index`` (plain tensors only).

    On CUDA the check is asynchronous (``torch._assert_async``: no host synchronisation); on other
    devices it raises :class:`ConfigurationError` at once.
    """
    if labels.numel() == 0:
        return
    bad = ((labels < 0) | (labels >= vocab)) & (labels != ignore_index)
    if labels.device.type == "cuda":
        torch._assert_async(
            ~bad.any(), f"labels must lie in [0, {vocab}) or equal ignore_index={ignore_index}"
        )
        return
    if bool(bad.any()):
        first = int(labels[bad][0])
        raise ConfigurationError(
            f"label {first} is outside the vocabulary [0, {vocab}) and is not "
            f"ignore_index={ignore_index}; fix the labels or pass the right ignore_index."
        )
