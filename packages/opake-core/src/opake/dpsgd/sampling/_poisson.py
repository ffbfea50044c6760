"""Poisson sampling, plain and fixed-shape (truncated to ``B_max``, padded).

Implementation of :class:`~opake.dpsgd.sampling.PoissonSampler` and
:class:`~opake.dpsgd.sampling.FixedShapePoissonSampler`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from opake.accounting import truncation_probability
from opake.core.errors import ConfigurationError
from opake.dpsgd.randomness import Randomness
from opake.dpsgd.sampling._base import PADDING_INDEX, _BaseSampler, _int, _poisson_base, _rate

__all__ = ["FixedShapePoissonSampler", "PoissonSampler"]


class PoissonSampler(_BaseSampler):
    """Poisson sampling: every example joins each batch independently with probability q.

    Batch sizes vary (Binomial(N, q)) and batches may be **empty**; they are still yielded,
    because skipping them would change the sampling the accountant assumes. Use
    :class:`EmptyBatchCollate` so a ``DataLoader`` can collate an empty batch. This is the
    sampler ``opake.accounting`` accounts for: pass ``accounting_kwargs`` to
    ``accountant.step``.

    Args:
        dataset_size: N.
        sample_rate: q, the *global* rate (expected global batch = q·N).
        steps_per_epoch: batches per ``iter`` (``len``); default ``round(1/q)``.
        seed: ask for **reproducible, non-private** batches: the key is derived from this
            integer, so anyone who knows it knows every batch — and the amplification by
            subsampling the accountant assumes no longer holds. Default (``None``): a secure key
            from the operating system, never stored.
        randomness: an explicit :class:`~opake.dpsgd.randomness.Randomness` (with
            ``world_size > 1``, the same key on every rank, e.g. from
            ``opake.dpsgd.distributed.shared_randomness``); exclusive with ``seed``.
        rank: this process's shard. Every rank draws the same global batch and keeps
            ``global[rank::world_size]`` (sorted indices), so the shards partition it.
        world_size: the number of shards (processes).

    Example:
        >>> sampler = PoissonSampler(100, 0.05, seed=0)
        >>> len(sampler), sampler.expected_batch_size
        (20, 5.0)
        >>> [len(b) for b in sampler][:5]
        [2, 8, 7, 6, 8]
    """

    _kind = "poisson"

    def __init__(
        self,
        dataset_size: int,
        sample_rate: float,
        *,
        steps_per_epoch: int | None = None,
        seed: int | None = None,
        randomness: Randomness | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self._n = _int("dataset_size", dataset_size, minimum=1)
        self._q = _rate(sample_rate)
        super().__init__(
            *_poisson_base(
                type(self).__name__,
                self._q,
                steps_per_epoch,
                (randomness, seed),
                (rank, world_size),
            )
        )

    @property
    def dataset_size(self) -> int:
        return self._n

    @property
    def sample_rate(self) -> float:
        """The global Poisson rate q (what the accountant needs)."""
        return self._q

    @property
    def expected_batch_size(self) -> float:
        """q·N: divide the noisy gradient sum by this, never by the realised batch size."""
        return self._q * self._n

    @property
    def accounting_kwargs(self) -> dict[str, Any]:
        """Keyword arguments describing this sampling for ``accountant.step(...)``."""
        return {"sample_rate": self._q}

    def global_batch(self, step: int) -> np.ndarray:
        """Sorted indices of the global Poisson batch of ``step`` (identical on every rank)."""
        # one independent Bernoulli(q) per example (a 64-bit draw below ⌊q·2⁶⁴⌋)
        joined = self._source.bernoulli("poisson", _int("step", step, minimum=0), self._n, self._q)
        return np.flatnonzero(joined).astype(np.int64)

    def _batch(self, step: int) -> list[int]:
        batch: list[int] = self.global_batch(step)[self._rank :: self._world_size].tolist()
        return batch

    def _config(self) -> dict[str, Any]:
        return {
            "dataset_size": self._n,
            "sample_rate": self._q,
            "steps_per_epoch": self._steps_per_epoch,
        }


class FixedShapePoissonSampler(PoissonSampler):
    """Truncated Poisson sampling with a static batch shape: ``max_batch_size`` slots.

    Each step draws the same Poisson batch as :class:`PoissonSampler` with the same seed; if it
    has more than ``B_max`` examples a uniformly random ``B_max`` of them are kept (a
    *truncation*, counted in :attr:`truncated_steps`). The real indices come first, then
    :data:`PADDING_INDEX` up to ``B_max``; each rank gets ``B_max / world_size`` slots
    (``global[rank::world_size]``). Wrap the dataset in :class:`PaddedDataset` so padding
    slots load a filler example and every item carries its mask flag, then mask the padded
    examples' loss (or gradient) to zero before summing: the shapes never change, so
    ``torch.compile`` and CUDA graphs see one shape.

    Accounting: this is *not* plain Poisson sampling. ``accounting_kwargs`` carries
    ``max_batch_size`` and ``dataset_size`` so the accountant adds
    ``(1 + e^ε)·steps·P(Binomial(N+1, q) > B_max)`` to δ (see
    ``opake.accounting.truncation_probability``); pick ``B_max`` with
    ``opake.accounting.max_batch_size_for`` to make that negligible.

    Example:
        >>> from opake.dpsgd.sampling import padding_mask
        >>> sampler = FixedShapePoissonSampler(100, 0.05, max_batch_size=12, seed=0)
        >>> batch = next(iter(sampler))
        >>> len(batch), batch.count(PADDING_INDEX)
        (12, 10)
        >>> padding_mask(batch).sum().item()
        2
    """

    _kind = "fixed_shape_poisson"

    def __init__(
        self,
        dataset_size: int,
        sample_rate: float,
        max_batch_size: int,
        *,
        steps_per_epoch: int | None = None,
        seed: int | None = None,
        randomness: Randomness | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        super().__init__(
            dataset_size,
            sample_rate,
            steps_per_epoch=steps_per_epoch,
            seed=seed,
            randomness=randomness,
            rank=rank,
            world_size=world_size,
        )
        self._b_max = _int("max_batch_size", max_batch_size, minimum=1)
        if self._b_max % self._world_size:
            raise ConfigurationError(
                f"max_batch_size={self._b_max} is not divisible by world_size="
                f"{self._world_size}: every rank needs the same static shape; use a multiple"
            )
        if self._b_max < self.expected_batch_size:
            raise ConfigurationError(
                f"max_batch_size={self._b_max} is below the expected batch size "
                f"{self.expected_batch_size:g}: most steps would be truncated; use "
                "opake.accounting.max_batch_size_for(...) to pick it"
            )
        self._truncated = 0

    @property
    def max_batch_size(self) -> int:
        """B_max, the global number of slots."""
        return self._b_max

    @property
    def truncation_probability(self) -> float:
        """Per-step P(Binomial(N+1, q) > B_max), what the accountant charges to δ."""
        return truncation_probability(
            dataset_size=self._n, sample_rate=self._q, max_batch_size=self._b_max
        )

    @property
    def truncated_steps(self) -> int:
        """How many handed-out steps had to drop examples (already paid for in δ)."""
        return self._truncated

    @property
    def accounting_kwargs(self) -> dict[str, Any]:
        return {"sample_rate": self._q, "max_batch_size": self._b_max, "dataset_size": self._n}

    def global_slots(self, step: int) -> tuple[np.ndarray, bool]:
        """The ``B_max`` global slots of ``step`` (real indices sorted, then padding) and
        whether the Poisson batch was truncated."""
        batch = self.global_batch(step)
        truncated = batch.size > self._b_max
        if truncated:
            order = self._source.sort_keys("truncate", step, batch.size)
            batch = np.sort(batch[order[: self._b_max]])
        slots = np.full(self._b_max, PADDING_INDEX, dtype=np.int64)
        slots[: batch.size] = batch
        return slots, truncated

    def _batch(self, step: int) -> list[int]:
        slots, truncated = self.global_slots(step)
        self._truncated += int(truncated)
        batch: list[int] = slots[self._rank :: self._world_size].tolist()
        return batch

    def batch_at(self, step: int) -> list[int]:
        """This rank's slots of step ``step`` as iteration yields them, without moving the
        position or counting a truncation."""
        slots, _ = self.global_slots(_int("step", step, minimum=0))
        batch: list[int] = slots[self._rank :: self._world_size].tolist()
        return batch

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), "max_batch_size": self._b_max}

    def _extra_state(self) -> dict[str, Any]:
        return {"truncated_steps": self._truncated}

    def _check_extra_state(self, state: Mapping[str, Any]) -> None:
        _int("truncated_steps", state.get("truncated_steps", 0), minimum=0)

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        self._truncated = _int("truncated_steps", state.get("truncated_steps", 0), minimum=0)
