"""DP-SGD building blocks.

- :mod:`opake.dpsgd.clipping` — per-example gradients, clipped and summed (re-exported here);
- :mod:`opake.dpsgd.noise` — Gaussian noise, added once per logical step;
- :mod:`opake.dpsgd.randomness` — the keyed random source of noise and sampling;
- :mod:`opake.dpsgd.sampling` — Poisson, fixed-shape truncated Poisson and shuffle samplers;
- :mod:`opake.dpsgd.optimizer` — the DP optimizer step around any ``torch.optim`` optimizer;
- :mod:`opake.dpsgd.checkpoint` — atomic checkpoint and resume of the whole training state;
- :mod:`opake.dpsgd.bookkeeping` — the book-keeping per-example engine (``engine=``);
- :mod:`opake.dpsgd.distributed` — DP-SGD across ranks (DDP, FSDP2);
- :mod:`opake.dpsgd.training` — the whole DP training step composed once (``DPTraining``).

The main names of those modules are available here too (imported on first use).

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

_LAZY = {
    "GaussianNoise": "noise",
    "NoisyGrads": "noise",
    "add_noise": "noise",
    "PoissonSampler": "sampling",
    "FixedShapePoissonSampler": "sampling",
    "ShuffleSampler": "sampling",
    "EmptyBatchCollate": "sampling",
    "PaddedDataset": "sampling",
    "PADDING_INDEX": "sampling",
    "padding_mask": "sampling",
    "DPOptimizer": "optimizer",
    "StepReport": "optimizer",
    "autocast_loss": "optimizer",
    "Checkpoint": "checkpoint",
    "CheckpointError": "checkpoint",
    "save_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "BatchedLoss": "bookkeeping",
    "DistributedDPOptimizer": "distributed",
    "DPTraining": "training",
    "PrivacyBudgetExhausted": "training",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'opake.dpsgd' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"opake.dpsgd.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "PADDING_INDEX",
    "AdaptiveClipping",
    "AutoSClipping",
    "BatchedLoss",
    "Checkpoint",
    "CheckpointError",
    "ClipAux",
    "ClipState",
    "ClippedGrads",
    "DPOptimizer",
    "DPTraining",
    "DistributedDPOptimizer",
    "EmptyBatchCollate",
    "FixedClipping",
    "FixedShapePoissonSampler",
    "GaussianNoise",
    "GroupClipping",
    "NoisyGrads",
    "PaddedDataset",
    "PoissonSampler",
    "PrivacyBudgetExhausted",
    "ShuffleSampler",
    "StepReport",
    "adaptive_noise_split",
    "add_noise",
    "autocast_loss",
    "clip_state_from_dict",
    "clipped_grad",
    "gradient_noise_multiplier",
    "load_checkpoint",
    "padding_mask",
    "save_checkpoint",
]
