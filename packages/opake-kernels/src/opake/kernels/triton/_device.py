"""Which tensors the ``triton`` backend takes: CUDA ones, and CPU ones only under the Triton
interpreter. Every op of the backend checks its inputs here before it launches a kernel.
"""

from __future__ import annotations

import torch

from opake.core.errors import OperationError
from opake.kernels._triton_support import interpreting

__all__: list[str] = []

Tensor = torch.Tensor


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
