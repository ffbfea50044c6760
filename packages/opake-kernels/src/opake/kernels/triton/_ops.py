"""The ``triton`` backend's ops: checks, kernel launches (cores) and the vmap-native Functions."""

# ruff: noqa: PLR0917  (autograd.Function.apply and Triton launches take positional arguments only)

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.runtime.errors import OutOfResources

from opake.core.errors import OperationError
from opake.kernels._args import (
    LossSpec,
    check_approximate,
    check_ce_tensors,
    check_chunk_size,
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
from opake.kernels._math import token_loss
from opake.kernels._triton_support import interpreting
from opake.kernels.triton import _kernels as K
from opake.kernels.triton import _layer_kernels as LK

__all__ = [
    "LCEBlocks",
    "cross_entropy",
    "geglu",
    "lce_blocks",
    "linear_cross_entropy",
    "rms_norm",
    "rope",
    "swiglu",
]

Tensor = torch.Tensor
_F32 = torch.float32
_KIND = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


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


def _check_device(*tensors: Tensor | None) -> None:
    for t in tensors:
        if t is None:
            continue
        if t.device.type == "cpu" and not interpreting():
            raise OperationError(
                "the triton backend got CPU tensors; it runs on CUDA, or on the CPU only under "
                "the Triton interpreter (TRITON_INTERPRET=1 set before import). Use "
                "backend='chunked' on the CPU."
            )
        if t.device.type not in ("cpu", "cuda"):
            raise OperationError(
                f"the triton backend cannot run on {t.device.type!r} tensors; use "
                "backend='chunked'."
            )


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


def _row_warps(block: int) -> int:
    return 1 if interpreting() else min(16, max(1, block // 256))


def _rms_forward(
    x: Tensor, weight: Tensor | None, eps: float, offset: float
) -> tuple[Tensor, Tensor]:
    r, d = x.shape
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    rstd = torch.empty(r, dtype=_F32, device=x.device)
    if r == 0:
        return y, rstd
    x = x.contiguous()
    block = triton.next_power_of_2(d)
    LK.rms_norm_fwd_kernel[(r,)](
        x, weight.contiguous() if weight is not None else x, y, rstd, d, eps, offset,
        HAS_W=weight is not None, BLOCK_D=block, num_warps=_row_warps(block),
    )  # fmt: skip
    return y, rstd


def _rows_per_program(per_group: int) -> int:
    rows = 16
    while rows > 1 and per_group % rows:
        rows //= 2
    return rows


def _rms_backward(
    x: Tensor,
    weight: Tensor | None,
    rstd: Tensor,
    gy: Tensor,
    offset: float,
    needs: tuple[bool, bool],
    groups: int,
) -> tuple[Tensor | None, Tensor | None]:
    r, d = x.shape
    need_x, need_w = needs[0], needs[1] and weight is not None
    gx = torch.empty(r, d, dtype=x.dtype, device=x.device) if need_x else None
    per = r // groups if groups else 0
    rows = _rows_per_program(per) if per else 1
    programs = triton.cdiv(r, rows)
    part = torch.zeros(programs, d, dtype=_F32, device=x.device) if need_w else None
    if r > 0:
        x = x.contiguous()
        block = triton.next_power_of_2(d)
        LK.rms_norm_bwd_kernel[(programs,)](
            x, weight.contiguous() if weight is not None else x, rstd.contiguous(),
            gy.contiguous(), gx if gx is not None else x, part if part is not None else rstd,
            r, d, offset, HAS_W=weight is not None, NEED_X=need_x, NEED_W=need_w,
            ROWS=rows, BLOCK_D=block, num_warps=_row_warps(block),
        )  # fmt: skip
    gw = None
    if part is not None and weight is not None:
        gw = part.reshape(groups, -1, d).sum(1).to(weight.dtype)
    return gx, gw


def _gated_block() -> int:
    return 256 if interpreting() else 1024


def _gated_forward(gate: Tensor, up: Tensor, kind: str) -> Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    numel = gate.numel()
    if numel:
        block = _gated_block()
        LK.gated_fwd_kernel[(triton.cdiv(numel, block),)](
            gate, up, out, numel, KIND=_KIND[kind], BLOCK=block
        )
    return out


def _gated_backward(gate: Tensor, up: Tensor, g: Tensor, kind: str) -> tuple[Tensor, Tensor]:
    gate, up, g = gate.contiguous(), up.contiguous(), g.contiguous()
    ga = torch.empty_like(gate)
    gu = torch.empty_like(up)
    numel = gate.numel()
    if numel:
        block = _gated_block()
        LK.gated_bwd_kernel[(triton.cdiv(numel, block),)](
            gate, up, g, ga, gu, numel, KIND=_KIND[kind], BLOCK=block
        )
    return ga, gu


def _rope(x: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tensor:
    d = x.shape[-1]
    x = x.contiguous()
    out = torch.empty_like(x)
    rows = x.numel() // d if d else 0
    if rows == 0:
        return out
    table_shape = cos.shape[:-1]
    n_table = 1
    for s in table_shape:
        n_table *= s
    row_map = (
        torch.arange(n_table, device=x.device).reshape(table_shape).expand(x.shape[:-1]).reshape(-1)
    )
    half = d // 2
    block = triton.next_power_of_2(max(1, half))
    LK.rope_kernel[(rows,)](
        x, cos.reshape(-1, d).contiguous(), sin.reshape(-1, d).contiguous(), row_map, out,
        d, half, BACKWARD=backward, BLOCK=block, num_warps=_row_warps(block),
    )  # fmt: skip
    return out


def _rope_forward(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return _rope(x, cos, sin, backward=False)


def _rope_backward(g: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return _rope(g, cos, sin, backward=True)


_LCE = make_lce_function("Triton", _lce_forward, _lce_backward)
_CE = make_ce_function("Triton", _ce_forward, _ce_backward)
_RMS = make_rms_norm_function("Triton", _rms_forward, _rms_backward)
_GATED = make_pointwise_function("Triton", _gated_forward, _gated_backward)
_ROPE = make_rope_function("Triton", _rope_forward, _rope_backward)


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


def rms_norm(
    x: Tensor, weight: Tensor | None = None, *, eps: float = 1e-6, offset: float = 0.0
) -> Tensor:
    """Fused RMSNorm (fp32 math, one row per program); saves ``x`` and ``rstd`` only."""
    check_rms_norm_args(x, weight, eps, offset)
    _check_device(x, weight)
    d = x.shape[-1]
    y, _rstd = apply(_RMS, x.reshape(-1, d), weight, float(eps), float(offset))
    out: Tensor = y.reshape(x.shape)
    return out


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """Fused ``silu(gate) * up``; the backward recomputes the activation."""
    check_pointwise_tensors(gate, up)
    _check_device(gate)
    return apply_tensor(_GATED, gate, up, "silu")


def geglu(gate: Tensor, up: Tensor, *, approximate: str = "none") -> Tensor:
    """Fused ``gelu(gate) * up`` (exact erf, or ``approximate="tanh"``)."""
    check_pointwise_tensors(gate, up)
    kind = check_approximate(approximate)
    _check_device(gate)
    return apply_tensor(_GATED, gate, up, kind)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Fused rotary embedding; ``cos``/``sin`` rows are gathered per row of ``x`` (no copy of
    the broadcast tables)."""
    check_rope_tensors(x, cos, sin)
    _check_device(x, cos, sin)
    return apply_tensor(_ROPE, x, cos, sin)
