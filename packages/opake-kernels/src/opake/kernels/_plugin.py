"""opake-kernels' plugin: registers its backends through the public hook, like a third party."""

from __future__ import annotations

from opake.core.plugins import KernelBackend, hookimpl

__all__ = ["opake_kernel_backends"]


@hookimpl
def opake_kernel_backends() -> list[KernelBackend]:
    """The backends this distribution provides (ops are imported only when chosen)."""
    return [
        KernelBackend(
            name="torch",
            ops={
                "cross_entropy": "opake.kernels.torch:cross_entropy",
                "rms_norm": "opake.kernels.torch:rms_norm",
            },
            devices=("cpu", "cuda", "mps", "xpu"),
            priority=0,
        )
    ]
