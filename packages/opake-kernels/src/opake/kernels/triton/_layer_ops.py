"""The ``triton`` backend's layer ops: RMSNorm, gated activations (SwiGLU/GeGLU) and rotary
embedding (checks, kernel launches and the vmap-native Functions; the kernels are in
``_layer_kernels``).
"""

# ruff: noqa: PLR0917  (autograd.Function.apply and Triton launches take positional arguments only)

from __future__ import annotations

import torch
import triton

from opake.kernels._args import (
    check_approximate,
    check_pointwise_tensors,
    check_rms_norm_args,
    check_rope_tensors,
)
from opake.kernels._autograd import (
    apply,
    apply_tensor,
    make_pointwise_function,
    make_rms_norm_function,
    make_rope_function,
)
from opake.kernels._triton_support import interpreting
from opake.kernels.triton import _layer_kernels as LK
from opake.kernels.triton._device import _check_device

__all__ = ["geglu", "rms_norm", "rope", "swiglu"]

Tensor = torch.Tensor
_F32 = torch.float32
_KIND = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


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


_RMS = make_rms_norm_function("Triton", _rms_forward, _rms_backward)
_GATED = make_pointwise_function("Triton", _gated_forward, _gated_backward)
_ROPE = make_rope_function("Triton", _rope_forward, _rope_backward)


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
