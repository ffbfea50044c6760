"""Fused multi-tensor clip-and-accumulate for the vmap engine (Triton on CUDA, torch otherwise).

After the per-example gradients of a microbatch are formed, the vmap engine adds, for every
differentiated leaf ``j``, ``Σ_i c[i, j] · nan_to_num(G_j[i])`` to the fp32 sum of that leaf.
The torch path is one ``nan_to_num`` copy and one matrix-vector product per leaf (2 launches
per leaf, every per-example gradient read twice). :func:`clip_accumulate` does all leaves in
**one** Triton launch per dtype: a table of leaf pointers, one program per (leaf, column
block), each reading its column block of every example once, zeroing non-finite entries,
scaling by the example's factor and accumulating in fp32 (a non-finite example has factor 0,
and ``0 · NaN`` must not poison the sum).

When it runs: ``OPAKE_CLIP_KERNEL`` = ``auto`` (default: CUDA tensors with a working Triton),
``off`` (always torch), ``interpret`` (also CPU tensors through the Triton interpreter — for
tests; it needs ``TRITON_INTERPRET=1`` in the environment before the first launch). Anything
the kernel does not take (a differentiable call, a non-contiguous gradient, a dtype other than
fp32/fp16/bf16) uses the torch path.

>>> import torch
>>> grads = [torch.tensor([[1.0, float("nan")], [3.0, 4.0]])]
>>> sums = [torch.zeros(2)]
>>> clip_accumulate(grads, torch.tensor([[0.5], [1.0]]), sums)
'torch'
>>> sums[0].tolist()
[3.5, 4.0]
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

__all__ = ["clip_accumulate", "kernel_mode", "kernel_runs_on"]

_MODES = ("auto", "off", "interpret")
_BLOCK = 512
_KERNEL: Any = None


def kernel_mode() -> str:
    """``OPAKE_CLIP_KERNEL`` (``auto``, ``off`` or ``interpret``), validated."""
    mode = os.environ.get("OPAKE_CLIP_KERNEL", "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ConfigurationError(
            f"OPAKE_CLIP_KERNEL={mode!r}: expected one of {_MODES} ('auto' uses the fused "
            "Triton kernel on CUDA, 'off' never, 'interpret' also on CPU in the interpreter)"
        )
    return mode


def kernel_runs_on(device: torch.device) -> bool:
    """Whether :func:`clip_accumulate` launches the Triton kernel for tensors on ``device``."""
    mode = kernel_mode()
    if mode == "off":
        return False
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return bool(has_triton())
    if mode == "interpret" and device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigurationError(
                "OPAKE_CLIP_KERNEL=interpret needs TRITON_INTERPRET=1 in the environment before "
                "the first launch (Triton reads it when the kernel is defined)"
            )
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True
    return False


def _kernel() -> Any:
    """Import the kernel module on first use (``TRITON_INTERPRET`` is read at definition)."""
    global _KERNEL
    if _KERNEL is None:
        from opake.dpsgd.clipping._kernel_triton import scale_sum

        if scale_sum is None:
            raise ConfigurationError(
                "the fused clip kernel needs Triton (pip install triton), or OPAKE_CLIP_KERNEL=off"
            )
        _KERNEL = scale_sum
    return _KERNEL


def _torch_path(
    grads: Sequence[torch.Tensor], factors: torch.Tensor, sums: Sequence[torch.Tensor]
) -> None:
    import torch

    for j, (g, total) in enumerate(zip(grads, sums, strict=True)):
        flat = g.reshape(g.shape[0], -1).to(torch.float32).nan_to_num(0.0, 0.0, 0.0)
        total.add_((factors[:, j] @ flat).reshape(total.shape))


def clip_accumulate(
    grads: Sequence[torch.Tensor], factors: torch.Tensor, sums: Sequence[torch.Tensor]
) -> str:
    """``sums[j] += Σ_i factors[i, j] · nan_to_num(grads[j][i])`` in place, for every leaf.

    ``grads[j]`` is ``[m, *shape_j]`` (per-example gradients), ``factors`` ``[m, L]`` fp32,
    ``sums[j]`` the fp32 ``shape_j`` accumulator. Returns ``"triton"`` when the fused kernel
    ran, ``"torch"`` otherwise (see the module docstring for when).
    """
    import torch

    if len(grads) != len(sums) or factors.dim() != 2 or factors.shape[1] != len(grads):
        raise ConfigurationError(
            f"clip_accumulate: {len(grads)} gradients, {len(sums)} sums and factors of shape "
            f"{tuple(factors.shape)}; expected one sum per gradient and factors [m, leaves]"
        )
    if not grads:
        return "torch"
    device = sums[0].device
    usable = (
        kernel_runs_on(device)
        and factors.shape[0] > 0
        and all(
            g.is_contiguous()
            and g.device == device
            and g.dtype in (torch.float32, torch.float16, torch.bfloat16)
            for g in grads
        )
        and all(s.is_contiguous() and s.dtype == torch.float32 for s in sums)
    )
    if not usable:
        _torch_path(grads, factors, sums)
        return "torch"
    import triton.language as tl

    kernel = _kernel()
    m = int(factors.shape[0])
    table = factors.to(device=device, dtype=torch.float32).contiguous()
    dtypes = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
    for dtype, tl_dtype in dtypes.items():
        leaves = [j for j, g in enumerate(grads) if g.dtype == dtype]
        if not leaves:
            continue
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

        sub = table[:, leaves].contiguous()
        kernel[(len(block_leaf),)](
            ints([grads[j].data_ptr() for j in leaves]),
            ints([sums[j].data_ptr() for j in leaves]),
            ints([sums[j].numel() for j in leaves]),
            ints(block_leaf, torch.int32),
            ints(block_col, torch.int32),
            sub,
            m,
            len(leaves),
            DTYPE=tl_dtype,
            BLOCK=_BLOCK,
        )
    return "triton"
