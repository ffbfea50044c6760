"""opake-kernels' plugin: registers its backends through the public hook, like a third party.

Ops are named by the contract :mod:`opake.core.ops` and given as dotted paths, imported only when
selected, so loading plugins imports neither torch nor triton.
"""

from __future__ import annotations

from opake.core import ops
from opake.core.plugins import KernelBackend, hookimpl
from opake.kernels._triton_support import triton_available, triton_devices, triton_priority

__all__ = ["opake_kernel_backends"]

_EVERYWHERE = ("cpu", "cuda", "mps", "xpu")
#: the ops every opake-kernels backend implements (one signature per op, see the guide)
_EVERY_BACKEND = (*ops.MODEL_OPS, ops.CLIP_ACCUMULATE)
#: the book-keeping engine's ops (the per-example gradients of the projection inside a linear
#: CE, held implicitly, and the loss whose backward computes their norms): only the portable
#: ``chunked`` backend implements them; it runs everywhere
_IMPLICIT = (ops.LINEAR_CROSS_ENTROPY_EXAMPLE_GRADS, ops.LINEAR_CROSS_ENTROPY_RECORDED)
#: the vmap engine's scale-and-sum; ``chunked`` uses the reference (one product per leaf)
_CLIP_REFERENCE = f"opake.kernels.torch:{ops.CLIP_ACCUMULATE}"


def _ops(module: str, names: tuple[str, ...] = _EVERY_BACKEND) -> dict[str, str]:
    return {op: f"{module}:{op}" for op in names}


@hookimpl
def opake_kernel_backends() -> list[KernelBackend]:
    """The ``torch`` reference, the portable ``chunked`` backend and the ``triton`` backend."""
    return [
        KernelBackend("torch", _ops("opake.kernels.torch"), devices=_EVERYWHERE, priority=0),
        KernelBackend(
            "chunked",
            {
                **_ops("opake.kernels.chunked", (*ops.MODEL_OPS, *_IMPLICIT)),
                ops.CLIP_ACCUMULATE: _CLIP_REFERENCE,
            },
            devices=_EVERYWHERE,
            priority=10,
        ),
        KernelBackend(
            "triton",
            _ops("opake.kernels.triton"),
            devices=triton_devices(),
            priority=triton_priority(),
            available=triton_available,
        ),
    ]
