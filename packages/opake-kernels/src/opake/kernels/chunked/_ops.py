"""The ``chunked`` backend's ops: argument checks, tiling plan, then the vmap-native Function."""

# ruff: noqa: PLR0917  (autograd.Function.apply and Triton launches take positional arguments only)

from __future__ import annotations

import torch

from opake.kernels._args import (
    LossSpec,
    check_approximate,
    check_ce_tensors,
    check_lce_tensors,
    check_pointwise_tensors,
    check_rms_norm_args,
    check_rope_tensors,
    finish_loss,
    loss_spec,
)
from opake.kernels._autograd import (
    apply,
    apply_tensor,
    make_ce_function,
    make_lce_function,
    make_pointwise_function,
    make_rms_norm_function,
    make_rope_function,
)
from opake.kernels.chunked import _layer_cores, _loss_cores
from opake.kernels.chunked._workspace import resolve_chunking, rows_per_chunk

__all__ = ["cross_entropy", "geglu", "linear_cross_entropy", "rms_norm", "rope", "swiglu"]

Tensor = torch.Tensor
_TEMPS = 4 * 4  # bytes of fp32 temporaries per element processed


def _rms_fwd(x: Tensor, w: Tensor | None, eps: float, offset: float) -> tuple[Tensor, Tensor]:
    rows = rows_per_chunk(x.device, x.shape[-1] * _TEMPS)
    return _layer_cores.rms_norm_forward(x, w, eps, offset, rows)


def _rms_bwd(
    x: Tensor,
    w: Tensor | None,
    rstd: Tensor,
    gy: Tensor,
    offset: float,
    needs: tuple[bool, bool],
    groups: int,
) -> tuple[Tensor | None, Tensor | None]:
    rows = rows_per_chunk(x.device, x.shape[-1] * _TEMPS)
    return _layer_cores.rms_norm_backward(x, w, rstd, gy, offset, needs, groups, rows)


def _gated_fwd(gate: Tensor, up: Tensor, kind: str) -> Tensor:
    return _layer_cores.gated_forward(gate, up, kind, rows_per_chunk(gate.device, _TEMPS))


def _gated_bwd(gate: Tensor, up: Tensor, g: Tensor, kind: str) -> tuple[Tensor, Tensor]:
    return _layer_cores.gated_backward(gate, up, g, kind, rows_per_chunk(gate.device, 2 * _TEMPS))


def _rope_fwd(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return _layer_cores.rope_forward(x, cos, sin, rows_per_chunk(x.device, x.shape[-1] * _TEMPS))


def _rope_bwd(g: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return _layer_cores.rope_backward(g, cos, sin, rows_per_chunk(g.device, g.shape[-1] * _TEMPS))


def _precompute(
    spec: LossSpec, hidden: Tensor, weight: Tensor, bias: Tensor | None
) -> tuple[bool, bool, bool]:
    """Which gradients the forward pass may compute right away (one-vocabulary-tile case).

    Those of inputs that require grad, for a ``sum``/``mean`` loss; weight and bias only for a
    single segment (a per-example loss outside ``vmap`` would need one weight-sized gradient per
    example). Under ``vmap`` each example is one segment and gets its own.
    """
    if spec.reduction == "none" or not torch.is_grad_enabled():
        return (False, False, False)
    single = spec.n_seg == 1
    return (
        bool(hidden.requires_grad),
        bool(weight.requires_grad) and single,
        bias is not None and bool(bias.requires_grad) and single,
    )


_LCE = make_lce_function("Chunked", _loss_cores.lce_forward, _loss_cores.lce_backward)
_CE = make_ce_function("Chunked", _loss_cores.ce_forward, _loss_cores.ce_backward)
_RMS = make_rms_norm_function("Chunked", _rms_fwd, _rms_bwd)
_GATED = make_pointwise_function("Chunked", _gated_fwd, _gated_bwd)
_ROPE = make_rope_function("Chunked", _rope_fwd, _rope_bwd)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    logit_scale: float | None = None,
    logit_divisor: float | None = None,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    chunk_size: bool | int = True,
) -> Tensor:
    """Linear cross-entropy tiled over tokens and vocabulary; never holds the full logits.

    ``chunk_size``: ``True`` picks tiles from the device's workspace bound, an int caps the
    vocabulary tile width, ``False``/``0`` computes everything as one tile (see
    :func:`~opake.kernels.chunked.resolve_chunking`).

    >>> import torch
    >>> h, w = torch.zeros(3, 4), torch.zeros(5, 4)
    >>> round(linear_cross_entropy(h, w, torch.tensor([0, 1, -100]), chunk_size=2).item(), 4)
    1.6094
    """
    hidden, weight, labels, bias = check_lce_tensors(hidden, weight, labels, bias)
    spec = loss_spec(
        tuple(labels.shape),
        ignore_index=ignore_index,
        reduction=reduction,
        logit_scale=logit_scale,
        logit_divisor=logit_divisor,
        softcap=softcap,
        label_smoothing=label_smoothing,
    )
    h = hidden.shape[-1]
    # tokens: this call's count (per example under vmap: folded calls tile within it too)
    tiles = resolve_chunking(
        chunk_size, hidden.device, h, weight.shape[0], hidden.dtype, tokens=labels.numel()
    )
    loss = apply(
        _LCE,
        hidden.reshape(-1, h),
        weight,
        bias,
        labels.reshape(-1),
        spec,
        tiles,
        _precompute(spec, hidden, weight, bias),
    )[0]
    return finish_loss(loss, reduction, tuple(labels.shape))


def cross_entropy(
    logits: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    logit_scale: float | None = None,
    logit_divisor: float | None = None,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
) -> Tensor:
    """Cross-entropy on logits in bounded row chunks: no fp32 copy of all the logits is kept.

    The backward recomputes the softmax chunk by chunk and writes the gradient in the logits'
    dtype.

    >>> import torch
    >>> round(cross_entropy(torch.zeros(2, 4), torch.tensor([1, -100])).item(), 4)
    1.3863
    """
    logits, labels = check_ce_tensors(logits, labels)
    spec = loss_spec(
        tuple(labels.shape),
        ignore_index=ignore_index,
        reduction=reduction,
        logit_scale=logit_scale,
        logit_divisor=logit_divisor,
        softcap=softcap,
        label_smoothing=label_smoothing,
    )
    v = logits.shape[-1]
    rows = rows_per_chunk(logits.device, v * _TEMPS)
    loss, _lse = apply(_CE, logits.reshape(-1, v), labels.reshape(-1), spec, rows)
    return finish_loss(loss, reduction, tuple(labels.shape))


def rms_norm(
    x: Tensor, weight: Tensor | None = None, *, eps: float = 1e-6, offset: float = 0.0
) -> Tensor:
    """RMSNorm that saves only ``x`` and one fp32 ``rstd`` per row; fp32 math in row chunks.

    >>> import torch
    >>> rms_norm(torch.full((1, 2), 3.0), torch.ones(2), offset=1.0).tolist()
    [[1.9999998807907104, 1.9999998807907104]]
    """
    check_rms_norm_args(x, weight, eps, offset)
    d = x.shape[-1]
    y, _rstd = apply(_RMS, x.reshape(-1, d), weight, float(eps), float(offset))
    out: Tensor = y.reshape(x.shape)
    return out


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up``; saves only the inputs and recomputes the activation in backward.

    >>> import torch
    >>> swiglu(torch.zeros(2), torch.ones(2)).tolist()
    [0.0, 0.0]
    """
    check_pointwise_tensors(gate, up)
    return apply_tensor(_GATED, gate, up, "silu")


def geglu(gate: Tensor, up: Tensor, *, approximate: str = "none") -> Tensor:
    """``gelu(gate) * up`` (exact, or ``approximate="tanh"``); recomputes in backward.

    >>> import torch
    >>> geglu(torch.zeros(2), torch.ones(2)).tolist()
    [0.0, 0.0]
    """
    check_pointwise_tensors(gate, up)
    kind = check_approximate(approximate)
    return apply_tensor(_GATED, gate, up, kind)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding ``x·cos + rotate_half(x)·sin`` with an explicit (saved-input) backward.

    >>> import torch
    >>> rope(torch.tensor([[1.0, 2.0]]), torch.zeros(1, 2), torch.ones(1, 2)).tolist()
    [[-2.0, 1.0]]
    """
    check_rope_tensors(x, cos, sin)
    return apply_tensor(_ROPE, x, cos, sin)
