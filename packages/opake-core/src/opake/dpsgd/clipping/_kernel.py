"""The vmap engine's clip-and-accumulate: the kernel op when a backend provides one, else torch.

After the per-example gradients of a microbatch are formed, the vmap engine adds, for every
differentiated leaf ``j``, ``Σ_i c[i, j] · nan_to_num(G_j[i])`` to the fp32 sum of that leaf.
That is the kernel op :data:`opake.core.ops.CLIP_ACCUMULATE`, chosen by the same backend
selection as every other op (:func:`opake.core.plugins.select_kernel`: an explicit backend,
then ``OPAKE_KERNEL_BACKEND``, then the available backend of highest priority — opake-kernels'
fused Triton kernel on CUDA — then the ``torch`` reference). When the choice is the reference,
or no installed backend provides the op (opake-kernels is not installed), the engine runs its
own torch path (:func:`torch_clip_accumulate` here; the engine's inline loop may zero
non-finite entries in place). The choice is logged on ``opake.core``.

>>> import torch
>>> grads = [torch.tensor([[1.0, float("nan")], [3.0, 4.0]])]
>>> sums = [torch.zeros(2)]
>>> clip_accumulate(grads, torch.tensor([[0.5], [1.0]]), sums, backend="torch")
'torch'
>>> sums[0].tolist()
[3.5, 4.0]
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from opake.core import ops
from opake.core.errors import ConfigurationError, OperationError

if TYPE_CHECKING:
    import torch

__all__ = ["clip_accumulate", "kernel_runs_on", "torch_clip_accumulate"]

_REFERENCE = "torch"
_log = logging.getLogger("opake.core")
_reported: set[str] = set()


def torch_clip_accumulate(
    grads: Sequence[torch.Tensor], factors: torch.Tensor, sums: Sequence[torch.Tensor]
) -> str:
    """The torch path: ``sums[j] += factors[:, j] @ nan_to_num(fp32(grads[j]))`` per leaf (fp64
    gradients: scaled and summed in fp64, then rounded to fp32 once)."""
    import torch

    for j, (g, total) in enumerate(zip(grads, sums, strict=True)):
        wide = torch.float64 if g.dtype == torch.float64 else torch.float32
        flat = g.reshape(g.shape[0], -1).to(wide).nan_to_num(0.0, 0.0, 0.0)
        contrib = (factors[:, j].to(flat) @ flat).to(torch.float32)
        total.add_(contrib.reshape(total.shape))
    return _REFERENCE


def _fused(device: torch.device, backend: str | None = None) -> Callable[..., Any] | None:
    """The selected op when it is not the reference's (a fused kernel), else ``None``.

    No backend with the op on this device (opake-kernels not installed) means the torch path,
    logged once per device type; an explicit backend that cannot run raises, as for any op.
    """
    from opake.core.plugins import kernel_backends, select_kernel

    try:
        choice = select_kernel(ops.CLIP_ACCUMULATE, device, backend)
    except OperationError:
        explicit = backend is not None or _explicit_env()
        if explicit or any(ops.CLIP_ACCUMULATE in be.ops for be in kernel_backends().values()):
            raise
        if device.type not in _reported:
            _reported.add(device.type)
            _log.info(
                "clip_accumulate on %s: no kernel backend provides %r (install opake-kernels); "
                "the clipping engine's torch path runs",
                device.type,
                ops.CLIP_ACCUMULATE,
            )
        return None
    reference = kernel_backends().get(_REFERENCE)
    if (
        reference is not None
        and ops.CLIP_ACCUMULATE in reference.ops
        and choice.impl is reference.load_op(ops.CLIP_ACCUMULATE)
    ):
        return None  # the reference: the engine's own torch path is the same computation
    return choice.impl


def _explicit_env() -> bool:
    import os

    from opake.core.plugins import KERNEL_BACKEND_ENV

    return bool(os.environ.get(KERNEL_BACKEND_ENV, "").strip())


def _removed_switch() -> None:
    """``OPAKE_CLIP_KERNEL`` is no longer read: say so once instead of ignoring it quietly."""
    import os

    value = os.environ.get("OPAKE_CLIP_KERNEL")
    if value is not None and "OPAKE_CLIP_KERNEL" not in _reported:
        _reported.add("OPAKE_CLIP_KERNEL")
        _log.warning(
            "OPAKE_CLIP_KERNEL=%r is no longer read: the clip-and-accumulate op follows the "
            "kernel backend selection (OPAKE_KERNEL_BACKEND=torch for the torch path, "
            "OPAKE_KERNEL_BACKEND=triton with TRITON_INTERPRET=1 for the interpreter)",
            value,
        )


def kernel_runs_on(device: torch.device) -> bool:
    """Whether :func:`clip_accumulate` runs a fused kernel (not the torch path) on ``device``."""
    _removed_switch()
    return _fused(device) is not None


def clip_accumulate(
    grads: Sequence[torch.Tensor],
    factors: torch.Tensor,
    sums: Sequence[torch.Tensor],
    *,
    backend: str | None = None,
) -> str:
    """``sums[j] += Σ_i factors[i, j] · nan_to_num(grads[j][i])`` in place, for every leaf.

    ``grads[j]`` is ``[m, *shape_j]`` (per-example gradients), ``factors`` ``[m, L]`` fp32,
    ``sums[j]`` the fp32 ``shape_j`` accumulator. Returns the path that ran: ``"triton"`` for
    the fused kernel, ``"torch"`` otherwise (see the module docstring for when).
    """
    if len(grads) != len(sums) or factors.dim() != 2 or factors.shape[1] != len(grads):
        raise ConfigurationError(
            f"clip_accumulate: {len(grads)} gradients, {len(sums)} sums and factors of shape "
            f"{tuple(factors.shape)}; expected one sum per gradient and factors [m, leaves]"
        )
    if not grads:
        return _REFERENCE
    impl = _fused(sums[0].device, backend)
    if impl is None:
        return torch_clip_accumulate(grads, factors, sums)
    return str(impl(grads, factors, sums))
