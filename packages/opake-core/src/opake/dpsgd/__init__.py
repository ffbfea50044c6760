"""DP-SGD building blocks.

- :mod:`opake.dpsgd.clipping` — per-example gradients, clipped and summed (re-exported here);
- :mod:`opake.dpsgd.noise` — Gaussian noise, added once per logical step;
- :mod:`opake.dpsgd.optimizer` — the DP optimizer step around any ``torch.optim`` optimizer;
- :mod:`opake.dpsgd.checkpoint` — atomic checkpoint and resume of the whole training state.

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
