"""Checkpoint and resume the whole DP training state, written atomically.

:func:`save_checkpoint` stores the model, the :class:`~opake.dpsgd.optimizer.DPOptimizer`
(optimizer state, noise generator position, step count), the accountant's history, the
sampler's state, the clipping state, the global RNG states and the step, in one file written
through :func:`atomic_write` (temporary file in the same directory, ``fsync``, ``os.replace``):
a crash mid-write leaves the previous checkpoint intact. :func:`load_checkpoint` validates the
file and restores it so that the next step equals the uninterrupted run's, bit for bit. Files
hold only tensors and plain values and load with ``torch.load(weights_only=True)``.

Example:
    >>> import pathlib, tempfile, torch
    >>> from opake.dpsgd.checkpoint import load_checkpoint, save_checkpoint
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "ckpt.pt"
    >>> net = torch.nn.Linear(3, 1)
    >>> _ = save_checkpoint(path, step=12, model=net, extra={"note": "epoch 1"})
    >>> restored = torch.nn.Linear(3, 1)
    >>> ckpt = load_checkpoint(path, model=restored)
    >>> ckpt.step, ckpt.extra["note"], torch.equal(restored.weight, net.weight)
    (12, 'epoch 1', True)
"""

from __future__ import annotations

from opake.dpsgd.checkpoint._checkpoint import (
    Checkpoint,
    checkpoint_step,
    load_checkpoint,
    save_checkpoint,
)
from opake.dpsgd.checkpoint._file import CheckpointError, atomic_write

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "atomic_write",
    "checkpoint_step",
    "load_checkpoint",
    "save_checkpoint",
]
