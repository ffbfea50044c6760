"""The ``torch`` reference backend: plain PyTorch ops, correct everywhere, vmap-safe.

Every other backend is tested against these. They materialise the full logits and fp32
intermediates, so use them as the oracle and the fallback, not for memory.

>>> import torch
>>> from opake.kernels.torch import swiglu
>>> swiglu(torch.zeros(3), torch.ones(3)).tolist()
[0.0, 0.0, 0.0]
"""

from __future__ import annotations

from opake.kernels.torch._clip import clip_accumulate
from opake.kernels.torch._reference import (
    cross_entropy,
    geglu,
    linear_cross_entropy,
    rms_norm,
    rope,
    swiglu,
)

__all__ = [
    "clip_accumulate",
    "cross_entropy",
    "geglu",
    "linear_cross_entropy",
    "rms_norm",
    "rope",
    "swiglu",
]
