"""The ``torch`` reference backend: plain PyTorch ops, correct everywhere, vmap-safe."""

from __future__ import annotations

from opake.kernels.torch._ops import cross_entropy, rms_norm

__all__ = ["cross_entropy", "rms_norm"]
