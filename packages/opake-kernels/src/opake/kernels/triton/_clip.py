"""The ``triton`` backend's fused clip-and-accumulate: every leaf in one launch per dtype.

``sums[j] += Σ_i factors[i, j] · nan_to_num(grads[j][i])`` for every differentiated leaf ``j``.
The reference (:func:`opake.kernels.torch.clip_accumulate`) makes an fp32 copy of each leaf and
one matrix-vector product per leaf (2 launches per leaf, every per-example gradient read
twice). Here a table of leaf pointers drives one program per (leaf, column block), each reading
its column block of every example once, zeroing non-finite entries, scaling by the example's
factor and accumulating in fp32 (a non-finite example has factor 0, and ``0 · NaN`` must not
poison the sum).

Inputs the kernel does not take (a tensor on another device, a non-contiguous gradient, a dtype
other than fp32/fp16/bf16, a tensor of a ``torch.func`` transform) run the reference instead;
the call then returns ``"torch"`` and the fallback is logged once on ``opake.kernels``.
"""

# ruff: noqa: PLR0917  (Triton launches take positional arguments only)

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from opake.kernels.torch._clip import check_clip_args
from opake.kernels.torch._clip import clip_accumulate as _reference

__all__ = ["clip_accumulate", "fused_clip_usable"]

_BLOCK = 512
_log = logging.getLogger("opake.kernels")
_reported: set[str] = set()
_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


# a Triton kernel: triton.jit is untyped, and the kernel's parameters (pointers, constexprs)
# are specialised by Triton at launch, not annotated
@triton.jit  # type: ignore[untyped-decorator]
def _scale_sum(  # type: ignore[no-untyped-def]
    grad_ptrs,
    sum_ptrs,
    sizes,
    block_leaf,
    block_col,
    factors,
    m,
    n_leaves,
    DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``sums[leaf][cols] += Σ_i factors[i, leaf] · nan_to_num(grads[leaf][i, cols])``."""
    pid = tl.program_id(0)
    leaf = tl.load(block_leaf + pid)
    col = tl.load(block_col + pid).to(tl.int64)
    n = tl.load(sizes + leaf)
    g = tl.load(grad_ptrs + leaf).to(tl.pointer_type(DTYPE))
    s = tl.load(sum_ptrs + leaf).to(tl.pointer_type(tl.float32))
    offs = col + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(m):
        f = tl.load(factors + i * n_leaves + leaf)
        x = tl.load(g + i * n + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.where(tl.abs(x) < float("inf"), x, 0.0)  # NaN and ±Inf read as 0
        acc += f * x
    old = tl.load(s + offs, mask=mask)
    tl.store(s + offs, old + acc, mask=mask)


def _plain(t: torch.Tensor) -> bool:
    """Not a tensor of a ``torch.func`` transform (Triton cannot read their storage)."""
    return not torch._C._functorch.is_functorch_wrapped_tensor(t)


def fused_clip_usable(
    grads: Sequence[torch.Tensor], factors: torch.Tensor, sums: Sequence[torch.Tensor]
) -> tuple[bool, str]:
    """Whether the kernel takes these (already checked) inputs, and why not.

    >>> fused_clip_usable([torch.ones(2, 3).t()], torch.ones(3, 1), [torch.zeros(2)])
    (False, 'a per-example gradient is not contiguous')
    """
    device = sums[0].device if sums else factors.device
    if factors.shape[0] == 0 or not grads:
        return False, "no examples or no leaves"
    if not all(_plain(t) for t in (factors, *grads, *sums)):
        return False, "a tensor of a torch.func transform (vmap/grad) cannot be launched on"
    if any(g.device != device for g in grads):
        return False, "the tensors are on different devices"
    if not all(g.is_contiguous() for g in grads):
        return False, "a per-example gradient is not contiguous"
    if not all(s.is_contiguous() for s in sums):
        return False, "an accumulator is not contiguous"
    if len({s.data_ptr() for s in sums}) != len(sums):
        return False, "two leaves share an accumulator (concurrent blocks would race)"
    if not all(g.dtype in _DTYPES for g in grads):
        return False, "a per-example gradient is not fp32, fp16 or bf16"
    if any(t.requires_grad for t in (factors, *grads)):
        return False, "a differentiable call (the kernel has no backward)"
    return True, ""


def _launch(
    grads: Sequence[torch.Tensor], table: torch.Tensor, sums: Sequence[torch.Tensor]
) -> None:
    device = sums[0].device
    m = int(table.shape[0])
    for dtype, tl_dtype in _DTYPES.items():
        leaves = [j for j, g in enumerate(grads) if g.dtype == dtype]
        block_leaf: list[int] = []
        block_col: list[int] = []
        for k, j in enumerate(leaves):
            for col in range(0, sums[j].numel(), _BLOCK):
                block_leaf.append(k)
                block_col.append(col)
        if not block_leaf:
            continue

        def ints(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        _scale_sum[(len(block_leaf),)](
            ints([grads[j].data_ptr() for j in leaves]),
            ints([sums[j].data_ptr() for j in leaves]),
            ints([sums[j].numel() for j in leaves]),
            ints(block_leaf, torch.int32),
            ints(block_col),  # int64: a leaf may have more than 2**31 entries
            table[:, leaves].contiguous(),
            m,
            len(leaves),
            DTYPE=tl_dtype,
            BLOCK=_BLOCK,
        )


def clip_accumulate(
    grads: Sequence[torch.Tensor], factors: torch.Tensor, sums: Sequence[torch.Tensor]
) -> str:
    """``sums[j] += Σ_i factors[i, j] · nan_to_num(grads[j][i])`` in place, fused.

    Returns ``"triton"`` when the kernel ran, ``"torch"`` when the inputs needed the reference
    (see the module docstring). The inputs are not modified.
    """
    check_clip_args(grads, factors, sums)
    ok, why = fused_clip_usable(grads, factors, sums)
    if not ok:
        if why not in _reported:
            _reported.add(why)
            _log.info("clip_accumulate: the triton backend runs the reference here: %s", why)
        return _reference(grads, factors, sums)
    table = factors.to(device=sums[0].device, dtype=torch.float32).contiguous()
    _launch(grads, table, sums)
    return "triton"
