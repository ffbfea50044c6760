"""The ``triton`` backend: fused Triton kernels (CUDA; CPU only under ``TRITON_INTERPRET=1``).

Every op is a ``setup_context`` autograd.Function with an explicit ``vmap`` rule and a second
Function for its backward, so Triton never receives a vmap ``BatchedTensor``: the vmapped
dimension is folded into the token (row) dimension, and ``vmap(grad(...))`` yields per-example
gradients, including a per-example gradient of a shared ``weight``. Importing this module imports
Triton; set ``TRITON_INTERPRET`` before the import if you want the interpreter.
"""

from __future__ import annotations

from opake.kernels.triton._clip import clip_accumulate
from opake.kernels.triton._layer_ops import geglu, rms_norm, rope, swiglu
from opake.kernels.triton._loss_ops import (
    LCEBlocks,
    cross_entropy,
    lce_blocks,
    linear_cross_entropy,
)

__all__ = [
    "LCEBlocks",
    "clip_accumulate",
    "cross_entropy",
    "geglu",
    "lce_blocks",
    "linear_cross_entropy",
    "rms_norm",
    "rope",
    "swiglu",
]
