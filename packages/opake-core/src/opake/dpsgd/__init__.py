"""DP-SGD building blocks: per-example clipping (:mod:`opake.dpsgd.clipping`) and the step.

The clipping API is re-exported here for convenience:

>>> from opake.dpsgd import clipped_grad
>>> from opake.dpsgd.clipping import clipped_grad as same
>>> clipped_grad is same
True
"""

from __future__ import annotations

from opake.dpsgd.clipping import (
    AdaptiveClipping,
    AutoSClipping,
    ClipAux,
    ClippedGrads,
    ClipState,
    FixedClipping,
    GroupClipping,
    adaptive_noise_split,
    clip_state_from_dict,
    clipped_grad,
    gradient_noise_multiplier,
)

__all__ = [
    "AdaptiveClipping",
    "AutoSClipping",
    "ClipAux",
    "ClipState",
    "ClippedGrads",
    "FixedClipping",
    "GroupClipping",
    "adaptive_noise_split",
    "clip_state_from_dict",
    "clipped_grad",
    "gradient_noise_multiplier",
]
