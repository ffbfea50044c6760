"""opake-kernels' plugin: registers its backends through the public hook, like a third party.

Ops are dotted paths, imported only when selected, so loading plugins imports neither torch nor
triton.
"""

from __future__ import annotations

from opake.core.plugins import KernelBackend, hookimpl
from opake.kernels._triton_support import triton_available, triton_devices, triton_priority

__all__ = ["EXAMPLE_GRADS_OP", "OPS", "RECORDED_OP", "opake_kernel_backends"]

#: the ops every opake-kernels backend implements (one signature per op, see the guide)
OPS: tuple[str, ...] = (
    "linear_cross_entropy",
    "cross_entropy",
    "rms_norm",
    "swiglu",
    "geglu",
    "rope",
)
_EVERYWHERE = ("cpu", "cuda", "mps", "xpu")
#: the book-keeping engine's op: per-example gradients of the projection inside a linear CE,
#: held implicitly (only the portable ``chunked`` backend implements it; it runs everywhere)
EXAMPLE_GRADS_OP = "linear_cross_entropy_example_grads"
#: and the loss whose backward computes those norms in the hidden-gradient pass
RECORDED_OP = "linear_cross_entropy_recorded"


def _ops(module: str) -> dict[str, str]:
    return {op: f"{module}:{op}" for op in OPS}


@hookimpl
def opake_kernel_backends() -> list[KernelBackend]:
    """The ``torch`` reference, the portable ``chunked`` backend and the ``triton`` backend."""
    return [
        KernelBackend("torch", _ops("opake.kernels.torch"), devices=_EVERYWHERE, priority=0),
        KernelBackend(
            "chunked",
            {
                **_ops("opake.kernels.chunked"),
                EXAMPLE_GRADS_OP: f"opake.kernels.chunked:{EXAMPLE_GRADS_OP}",
                RECORDED_OP: f"opake.kernels.chunked:{RECORDED_OP}",
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
