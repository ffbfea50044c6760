"""Batch samplers for DP-SGD, usable as ``DataLoader(dataset, batch_sampler=...)``.

* :class:`PoissonSampler` — each example joins each batch independently with probability q;
  variable sizes, empty batches included (collate them with :class:`EmptyBatchCollate`). This is
  what ``opake.accounting`` accounts for.
* :class:`FixedShapePoissonSampler` — the same Poisson draw truncated to ``B_max`` and padded
  with :data:`PADDING_INDEX` (wrap the dataset in :class:`PaddedDataset` to get a mask), for
  static shapes. Accounted as Poisson plus the truncation probability in δ.
* :class:`ShuffleSampler` — fixed-size shuffled batches; **not** Poisson, so the accountants'
  ε does not apply (an :class:`~opake.core.errors.OpakePrivacyWarning` says so, and
  ``DPOptimizer``, ``DPTraining`` and ``DPTrainer`` refuse it).
* :class:`UnitPoissonSampler` — Poisson sampling of privacy units (users): each unit joins a
  batch with probability q and brings its records (at most a cap of them); with each unit's
  gradient clipped as one, ε holds per unit.

Each batch is a pure function of ``(seed, step)``: resuming needs only ``state_dict()`` (or
``seek(step)``), ``batch_at(step)`` recomputes any step's batch without moving the position,
and ranks that share the seed draw the same global batch and each keep the shard
``global[rank::world_size]``.

Example:
    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> from opake.dpsgd.sampling import EmptyBatchCollate, PoissonSampler
    >>> data = TensorDataset(torch.randn(50, 3))
    >>> sampler = PoissonSampler(len(data), sample_rate=0.02, seed=3)
    >>> loader = DataLoader(data, batch_sampler=sampler, collate_fn=EmptyBatchCollate(data))
    >>> sizes = [x.shape[0] for (x,) in loader]
    >>> len(sizes), 0 in sizes  # 50 steps per epoch; some batches are empty
    (50, True)
"""

from __future__ import annotations

from opake.dpsgd.sampling._base import PADDING_INDEX
from opake.dpsgd.sampling._data import EmptyBatchCollate, PaddedDataset, padding_mask
from opake.dpsgd.sampling._poisson import FixedShapePoissonSampler, PoissonSampler
from opake.dpsgd.sampling._shuffle import ShuffleSampler
from opake.dpsgd.sampling._units import (
    UnitPoissonSampler,
    UnitSummary,
    count_units,
    unit_batch_rows,
)

__all__ = [
    "PADDING_INDEX",
    "EmptyBatchCollate",
    "FixedShapePoissonSampler",
    "PaddedDataset",
    "PoissonSampler",
    "ShuffleSampler",
    "UnitPoissonSampler",
    "UnitSummary",
    "count_units",
    "padding_mask",
    "unit_batch_rows",
]
