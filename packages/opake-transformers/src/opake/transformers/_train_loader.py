"""``DPTrainer``'s training ``DataLoader``, and the checks that the Trainer trains on it alone.

ε is computed for Opake's Poisson sampling (plain, or fixed-shape truncated Poisson) and for
nothing else, so a training loop fed any other batch order would log an ε that does not hold.
Two checks refuse that before any example of such a batch is used:

- :func:`check_train_loader` (when training begins): the ``DataLoader`` the Trainer is about to
  iterate must be the very object :func:`poisson_loader` built, with the very
  :class:`~opake.transformers._collate.PoissonBatches` it was given as ``batch_sampler``. A
  subclass whose ``get_train_dataloader`` returns a shuffled or sequential ``DataLoader``, one
  with a ``batch_sampler`` of its own, the loader wrapped (``accelerator.prepare`` would also
  re-shard it) or with its sampler replaced: refused, naming what was given.
- :class:`DrawnBatches` (every physical batch): the batch's example indices, recorded by the
  collate function, must be exactly this rank's share of the DP sampler's draw for the step
  being accumulated (``sampler.batch_at(step)``, split as the loader splits it). Whatever path
  a batch took to ``training_step``, one that the Poisson sampler did not draw is refused.

Neither message quotes indices or batch sizes: which examples a Poisson batch holds is exactly
what the accounting assumes stays secret.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from opake.core.errors import ConfigurationError
from opake.transformers._collate import PoissonBatches, physical_batches

__all__ = [
    "BATCH_INDICES_KEY",
    "EXAMPLE_MASK_KEY",
    "DrawnBatches",
    "IndexedDataset",
    "check_train_loader",
    "describe_loader",
    "poisson_loader",
]

#: key of the padding mask in a fixed-shape batch (removed before the model sees the batch)
EXAMPLE_MASK_KEY = "opake_example_mask"
#: key of the batch's example indices (checked against the DP sampler, then removed)
BATCH_INDICES_KEY = "opake_batch_indices"

_FIX = (
    "do not override get_train_dataloader (or return its loader unchanged: neither wrapped nor "
    "with its sampler replaced) — pass the data as train_dataset and choose the sampling with "
    "DPTrainingArguments(dp_sampler='poisson' or 'fixed')"
)


def _sampling(mode: str) -> str:
    return "fixed-shape truncated Poisson" if mode == "fixed" else "Poisson"


class IndexedDataset(torch.utils.data.Dataset[tuple[int, Any]]):
    """``dataset[i]`` → ``(i, dataset[i])``, so that collation can record each batch's indices."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return index, self.dataset[index]


def poisson_loader(
    dataset: Any,
    collator: Callable[[list[Any]], dict[str, Any]],
    batches: PoissonBatches,
    *,
    fixed: bool,
    num_workers: int,
    pin_memory: bool,
) -> torch.utils.data.DataLoader[Any]:
    """The training ``DataLoader``: ``batches`` as ``batch_sampler``; every collated batch
    carries its indices (:data:`BATCH_INDICES_KEY`) and, for fixed shapes, its padding mask
    (:data:`EXAMPLE_MASK_KEY`). Empty Poisson batches collate to tensors of length 0."""
    from opake.dpsgd.sampling import EmptyBatchCollate, PaddedDataset

    indexed = IndexedDataset(PaddedDataset(dataset) if fixed else dataset)

    def collate(items: list[tuple[int, Any]]) -> dict[str, Any]:
        examples = [item for _, item in items]
        if fixed:
            batch = collator([example for example, _ in examples])
            batch[EXAMPLE_MASK_KEY] = torch.tensor([real for _, real in examples])
        else:
            batch = collator(examples)
        batch[BATCH_INDICES_KEY] = torch.tensor([i for i, _ in items], dtype=torch.int64)
        return batch

    return torch.utils.data.DataLoader(
        indexed,
        batch_sampler=batches,
        collate_fn=EmptyBatchCollate(indexed, collate_fn=collate),
        num_workers=num_workers,
        pin_memory=pin_memory,
    )


def describe_loader(loader: object) -> str:
    """What a training loader draws its batches with, e.g.
    ``DataLoader(batch_sampler=BatchSampler(RandomSampler))`` (names only, no data)."""
    if loader is None:
        return "no DataLoader"
    part = getattr(loader, "batch_sampler", None)
    name = "batch_sampler"
    if part is None:
        part, name = getattr(loader, "sampler", None), "sampler"
    if part is None:
        return type(loader).__name__
    label = type(part).__name__
    # a torch BatchSampler's sampler, or the batch sampler accelerate's shard wraps
    inner = getattr(part, "batch_sampler", None)
    if inner is None:
        inner = getattr(part, "sampler", None)
    if hasattr(inner, "__iter__"):
        label += f"({type(inner).__name__})"
    return f"{type(loader).__name__}({name}={label})"


def check_train_loader(loader: object, ours: Any, batches: Any, *, mode: str) -> None:
    """Refuse any training loader but the one ``DPTrainer.get_train_dataloader`` built last
    (``ours``, with ``batches`` as its ``batch_sampler``)."""
    if ours is not None and loader is ours and getattr(loader, "batch_sampler", None) is batches:
        return
    raise ConfigurationError(
        f"DPTrainer: the training loop was given {describe_loader(loader)}, not the loader "
        f"DPTrainer.get_train_dataloader builds ({_sampling(mode)} batches, dp_sampler="
        f"{mode!r}); ε is computed for that sampling only and would not hold for these "
        f"batches: {_FIX}"
    )


class DrawnBatches:
    """Checks that each physical batch is this rank's share of the DP sampler's draw.

    Physical batch ``k`` of logical step ``t`` must hold exactly
    ``physical_batches(sampler, sampler.batch_at(t), chunks)[k]`` (padding slots included, for
    fixed shapes; cut at unit boundaries for a unit sampler). The draw of the current step is
    recomputed once per step. ``k`` is counted here: the physical batches that passed the
    check since the step's first (the DP step's own count is of compiled chunks when
    compiled, several per physical batch).
    """

    def __init__(self, chunks: int, mode: str) -> None:
        self._chunks = chunks
        self._mode = mode
        self._step: int | None = None
        self._parts: list[list[int]] = []
        self._count = 0  # physical batches checked in the step in progress

    def check(self, indices: Any, sampler: Any, step: int, pending: bool) -> None:
        """Refuse the next physical batch of step ``step`` unless ``indices`` (the batch's
        :data:`BATCH_INDICES_KEY` tensor, ``None`` when absent) are the sampler's draw;
        ``pending``: the step already holds a batch (else this is its first: a new step, or
        one dropped after an error)."""
        if self._step != step:
            self._parts = physical_batches(sampler, sampler.batch_at(step), self._chunks)
            self._step = step
        index = self._count if pending else 0
        expected = self._parts[index] if index < len(self._parts) else None
        if isinstance(indices, torch.Tensor) and indices.tolist() == expected:
            self._count = index + 1
            return
        reason = (
            "carries no sampler indices: it was not collated by DPTrainer's training loader"
            if indices is None
            else f"holds other examples than DPTrainer's {_sampling(self._mode)} sampler drew "
            "for it"
        )
        raise ConfigurationError(
            f"DPTrainer: physical batch {index + 1} of DP step {step + 1} {reason}; ε is "
            f"computed for that sampling (dp_sampler={self._mode!r}) only: {_FIX}"
        )
