"""The Triton kernel of :mod:`opake.dpsgd.clipping._kernel` (imported only when it launches).

One program per (leaf, column block): ``sum[cols] += Σ_i factor[i, leaf] · g[i, cols]`` with
non-finite entries of ``g`` read as 0, accumulated in fp32. ``grad_ptrs`` / ``sum_ptrs`` are
int64 tables of the leaves' data pointers (a multi-tensor launch); ``sizes`` their numel.
"""

from typing import Any

try:
    import triton
    import triton.language as tl
except ImportError:  # opake-core does not depend on Triton; clip_accumulate then uses torch
    triton = None

__all__ = ["scale_sum"]

scale_sum: Any = None


def _scale_sum(  # type: ignore[no-untyped-def]  # noqa: PLR0917 - a kernel signature
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


if triton is not None:
    scale_sum = triton.jit(_scale_sum)
