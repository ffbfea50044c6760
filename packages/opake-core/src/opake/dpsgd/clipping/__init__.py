"""Per-example gradient clipping: the first half of a DP-SGD step.

:func:`clipped_grad` builds ``grad_fn``; ``grad_fn(*args, state=state)`` returns the fp32 sum of
per-example gradients, each clipped, as a :class:`ClippedGrads` dict whose ``max_norm`` is the
sum's L2 sensitivity (calibrate noise as ``σ · grads.max_norm``), plus the next clip state.
``grad_fn(..., units=ids)`` clips privacy units instead (each unit's rows summed, then clipped).

Clipping methods (each a frozen, serialisable dataclass that is both configuration and state):
:class:`FixedClipping` (``clipping_norm=1.0`` is shorthand), :class:`GroupClipping`
(``clipping_norm={"group": C, ...}``), :class:`AutoSClipping` and :class:`AdaptiveClipping`
(whose count query costs privacy: see :func:`adaptive_noise_split` and
:func:`gradient_noise_multiplier`, the same as in :mod:`opake.accounting`). The diagnostics
in :class:`ClipAux` are not private.

>>> import torch
>>> from opake.dpsgd.clipping import clipped_grad
>>> grad_fn, state = clipped_grad(lambda p, x: (p["w"] * x).sum(), clipping_norm=0.5)
>>> grads, state = grad_fn({"w": torch.zeros(2)}, torch.ones(3, 2), state=state)
>>> grads["w"], grads.max_norm
(tensor([1.0607, 1.0607]), 0.5)
"""

from __future__ import annotations

from opake.core.choices import ENGINES
from opake.dpsgd.clipping._api import clipped_grad
from opake.dpsgd.clipping._base import EPS, ChunkNorms, ClipFactors, whole_gradient_factors
from opake.dpsgd.clipping._grad_fn import ClippedGradFn
from opake.dpsgd.clipping._grads import ClipAux, ClippedGrads
from opake.dpsgd.clipping._state import (
    AdaptiveClipping,
    AdaptiveNoiseSplit,
    AutoSClipping,
    ClipState,
    FixedClipping,
    GroupClipping,
    adaptive_noise_split,
    clip_state_from_dict,
    gradient_noise_multiplier,
)

__all__ = [
    "ENGINES",
    "EPS",
    "AdaptiveClipping",
    "AdaptiveNoiseSplit",
    "AutoSClipping",
    "ChunkNorms",
    "ClipAux",
    "ClipFactors",
    "ClipState",
    "ClippedGradFn",
    "ClippedGrads",
    "FixedClipping",
    "GroupClipping",
    "adaptive_noise_split",
    "clip_state_from_dict",
    "clipped_grad",
    "gradient_noise_multiplier",
    "whole_gradient_factors",
]
