"""The ``triton`` backend's loss ops: linear cross-entropy and cross-entropy (checks, launch
settings, kernel launches and the vmap-native Functions; the kernels are in ``_kernels``).
"""

# ruff: noqa: PLR0917  (autograd.Function.apply and Triton launches take positional arguments only)

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.runtime.errors import OutOfResources

from opake.kernels._args import (
    LossSpec,
    check_ce_tensors,
    check_chunk_size,
    check_lce_tensors,
    finish_loss,
    loss_spec,
)
from opake.kernels._autograd import apply, make_ce_function, make_lce_function
from opake.kernels._math import token_loss
from opake.kernels._triton_support import interpreting
from opake.kernels.triton import _kernels as K
from opake.kernels.triton._device import _check_device

__all__ = ["LCEBlocks", "cross_entropy", "lce_blocks", "linear_cross_entropy"]

Tensor = torch.Tensor
_F32 = torch.float32


@dataclass(frozen=True)
class LCEBlocks:
    """Tile sizes and launch settings of the linear-cross-entropy kernels."""

    block_t: int
    block_v: int
    block_h: int
    num_warps: int
    num_stages: int


def lce_blocks(dtype: torch.dtype, hidden: int) -> LCEBlocks:
    """Blocks for the device in use: large on a GPU, small (but >= 16, as GPUs need) when
    interpreting, where every program runs in Python.

    >>> import torch
    >>> lce_blocks(torch.bfloat16, 4096).block_t >= 16
    True
    """
    if interpreting():
        bh = min(64, max(16, triton.next_power_of_2(hidden)))
        return LCEBlocks(16, 32, bh, 4, 1)
    if dtype == _F32:
        return LCEBlocks(64, 64, 32, 4, 2)
    return LCEBlocks(64, 128, 64, 8, 3)


def _common(spec: LossSpec) -> dict[str, object]:
    return {
        "mult": 1.0 if spec.mult is None else spec.mult,
        "softcap": 1.0 if spec.softcap is None else spec.softcap,
        "smoothing": spec.smoothing,
        "HAS_MULT": spec.mult is not None,
        "HAS_SOFTCAP": spec.softcap is not None,
        "HAS_SMOOTH": spec.smoothing > 0.0,
    }


def _precision(dtype: torch.dtype) -> dict[str, object]:
    interp = interpreting()
    return {"UPCAST": interp, "PREC": "ieee" if (interp or dtype == _F32) else "tf32"}


def _launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Launch *kernel*; if its software pipelining does not fit the device's shared memory,
    relaunch with a single stage (same blocks, same results)."""
    try:
        kernel[grid](*args, **kwargs)
    except OutOfResources:
        if kwargs.get("num_stages", 1) <= 1:
            raise
        kernel[grid](*args, **{**kwargs, "num_stages": 1})


def _vocab_splits(token_blocks: int, vocab_blocks: int, device: torch.device) -> int:
    """How many programs share one token block's vocabulary in the forward kernel: enough for
    about two programs per multiprocessor (2 under the interpreter, to exercise the path)."""
    if interpreting():
        target = 2 * token_blocks
    else:
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    groups: int = triton.cdiv(target, max(1, token_blocks))
    return max(1, min(vocab_blocks, groups))


def _lce_forward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    spec: LossSpec,
    opts: object,
    pre: tuple[bool, bool, bool],
) -> tuple[Tensor, Tensor, None]:
    n, hsize = hidden.shape
    v = weight.shape[0]
    if n == 0:
        empty = torch.empty(0, dtype=_F32, device=hidden.device)
        return empty, empty.clone(), None
    hidden, weight = hidden.contiguous(), weight.contiguous()
    labels = labels.contiguous()
    b = lce_blocks(hidden.dtype, hsize)
    token_blocks = triton.cdiv(n, b.block_t)
    vocab_blocks = triton.cdiv(v, b.block_v)
    splits = _vocab_splits(token_blocks, vocab_blocks, hidden.device)
    per_split = triton.cdiv(vocab_blocks, splits) * b.block_v
    splits = triton.cdiv(v, per_split)
    part = torch.empty(4, splits, n, dtype=_F32, device=hidden.device)
    c = _common(spec)
    _launch(
        K.lce_fwd_kernel, (token_blocks, splits),
        hidden, weight, bias if bias is not None else weight, labels, part,
        n, v, hsize, hidden.stride(0), weight.stride(0), per_split, c["mult"], c["softcap"],
        HAS_BIAS=bias is not None, HAS_MULT=c["HAS_MULT"], HAS_SOFTCAP=c["HAS_SOFTCAP"],
        HAS_SMOOTH=c["HAS_SMOOTH"], **_precision(hidden.dtype),
        BLOCK_T=b.block_t, BLOCK_V=b.block_v, BLOCK_H=b.block_h,
        num_warps=b.num_warps, num_stages=b.num_stages,
    )  # fmt: skip
    m, s, zy, zs = part.unbind(0)
    top = m.amax(0)
    lse = top + torch.log((s * torch.exp(m - top)).sum(0))
    loss = token_loss(lse, zy.sum(0), zs.sum(0), v, spec)
    loss = torch.where(labels != spec.ignore_index, loss, torch.zeros_like(loss))
    return loss, lse, None  # the backward kernels recompute the tiles


def _lce_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    lse: Tensor,
    tgrad: Tensor,
    spec: LossSpec,
    opts: object,
    needs: tuple[bool, bool, bool],
    groups: int,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    n, hsize = hidden.shape
    v = weight.shape[0]
    need_h, need_w, need_b = needs[0], needs[1], needs[2] and bias is not None
    dev = hidden.device
    gh = torch.zeros(n, hsize, dtype=_F32, device=dev) if need_h else None
    gw = torch.zeros(groups, v, hsize, dtype=_F32, device=dev) if need_w else None
    gb = torch.zeros(groups, v, dtype=_F32, device=dev) if need_b else None
    if n > 0:
        hidden, weight = hidden.contiguous(), weight.contiguous()
        labels, lse, tgrad = labels.contiguous(), lse.contiguous(), tgrad.contiguous().float()
        b = lce_blocks(hidden.dtype, hsize)
        launch = {
            **_common(spec),
            **_precision(hidden.dtype),
            "HAS_BIAS": bias is not None,
            "BLOCK_T": b.block_t,
            "BLOCK_V": b.block_v,
            "BLOCK_H": b.block_h,
            "num_warps": b.num_warps,
            "num_stages": b.num_stages,
        }
        bias_arg = bias if bias is not None else weight
        if gh is not None:
            _launch(
                K.lce_bwd_h_kernel, (triton.cdiv(n, b.block_t),),
                hidden, weight, bias_arg, labels, lse, tgrad, gh,
                n, v, hsize, hidden.stride(0), weight.stride(0), **launch,
            )  # fmt: skip
        if gw is not None or gb is not None:
            _launch(
                K.lce_bwd_w_kernel, (triton.cdiv(v, b.block_v), groups),
                hidden, weight, bias_arg, labels, lse, tgrad,
                gw if gw is not None else lse, gb if gb is not None else lse,
                n // groups, v, hsize, hidden.stride(0), weight.stride(0),
                NEED_W=gw is not None, NEED_B=gb is not None, **launch,
            )  # fmt: skip
    return (
        None if gh is None else gh.to(hidden.dtype),
        None if gw is None else gw.to(weight.dtype),
        None if gb is None or bias is None else gb.to(bias.dtype),
    )


def _ce_blocks() -> tuple[int, int, int]:
    return (16, 32, 4) if interpreting() else (8, 512, 4)


def _ce_forward(
    logits: Tensor, labels: Tensor, spec: LossSpec, opts: object
) -> tuple[Tensor, Tensor]:
    n, v = logits.shape
    loss = torch.empty(n, dtype=_F32, device=logits.device)
    lse = torch.empty(n, dtype=_F32, device=logits.device)
    if n == 0:
        return loss, lse
    logits, labels = logits.contiguous(), labels.contiguous()
    bt, bv, warps = _ce_blocks()
    K.ce_fwd_kernel[(triton.cdiv(n, bt),)](
        logits, labels, loss, lse, n, v, logits.stride(0), spec.ignore_index,
        **_common(spec), BLOCK_T=bt, BLOCK_V=bv, num_warps=warps,
    )  # fmt: skip
    return loss, lse


def _ce_backward(
    logits: Tensor, labels: Tensor, lse: Tensor, tgrad: Tensor, spec: LossSpec, opts: object
) -> Tensor:
    n, v = logits.shape
    out = torch.empty(n, v, dtype=logits.dtype, device=logits.device)
    if n == 0:
        return out
    logits, labels = logits.contiguous(), labels.contiguous()
    bt, bv, warps = _ce_blocks()
    K.ce_bwd_kernel[(triton.cdiv(n, bt),)](
        logits, labels, lse.contiguous(), tgrad.contiguous().float(), out,
        n, v, logits.stride(0), **_common(spec), BLOCK_T=bt, BLOCK_V=bv, num_warps=warps,
    )  # fmt: skip
    return out


_LCE = make_lce_function("Triton", _lce_forward, _lce_backward)
_CE = make_ce_function("Triton", _ce_forward, _ce_backward)


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
    """Fused linear cross-entropy: 2-D tiles, online log-sum-exp, tiles recomputed in backward.

    ``chunk_size`` is accepted for a uniform signature and ignored (the kernels tile
    themselves, see :func:`lce_blocks`).
    """
    hidden, weight, labels, bias = check_lce_tensors(hidden, weight, labels, bias)
    check_chunk_size(chunk_size)
    _check_device(hidden, weight, bias)
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
    flat_h, flat_y = hidden.reshape(-1, h), labels.reshape(-1)
    loss = apply(_LCE, flat_h, weight, bias, flat_y, spec, None, (False, False, False))[0]
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
    """Cross-entropy on logits in one pass per row block; the backward writes the gradient in
    the logits' dtype without an fp32 copy of the logits."""
    logits, labels = check_ce_tensors(logits, labels)
    _check_device(logits)
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
    loss, _lse = apply(_CE, logits.reshape(-1, v), labels.reshape(-1), spec, None)
    return finish_loss(loss, reduction, tuple(labels.shape))
