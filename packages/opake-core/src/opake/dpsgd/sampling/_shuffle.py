"""Shuffled fixed-size batches (not Poisson: the accountants' ε does not apply).

Implementation of :class:`~opake.dpsgd.sampling.ShuffleSampler`.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np

from opake.core.errors import ConfigurationError, InputTypeError, OpakePrivacyWarning
from opake.dpsgd.randomness import Randomness
from opake.dpsgd.sampling._base import _BaseSampler, _int, _sharding, _source

__all__ = ["ShuffleSampler"]


class ShuffleSampler(_BaseSampler):
    """Fixed-size batches from a seeded shuffle per epoch (sampling without replacement).

    **Not Poisson sampling.** Opake's accountants compute ε for Poisson sampling at rate q;
    that figure does not hold for shuffled fixed-size batches (the privacy amplification of
    shuffling is different and weaker in general), so constructing this sampler emits an
    :class:`~opake.core.errors.OpakePrivacyWarning`. Use it for non-private baselines and
    debugging, or with an accounting you do yourself. Opake's private training paths refuse
    it with a :class:`~opake.core.errors.ConfigurationError`, with or without a sample rate:
    ``DPOptimizer(sampler=...)``, ``DPTraining(sampler=...)`` and ``DPTrainer`` (whose training
    loop takes only the Poisson batches it draws itself).

    Args:
        dataset_size: N.
        batch_size: global batch size B; each rank gets ``global[rank::world_size]``.
        drop_last: drop the last incomplete batch of each epoch (default: keep shapes fixed).
        seed: as :class:`PoissonSampler`.
        randomness: as :class:`PoissonSampler`.
        rank: as :class:`PoissonSampler`.
        world_size: as :class:`PoissonSampler`.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     sampler = ShuffleSampler(10, 4, seed=0)
        >>> [len(b) for b in sampler]
        [4, 4]
    """

    _kind = "shuffle"

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        *,
        drop_last: bool = True,
        seed: int | None = None,
        randomness: Randomness | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self._n = _int("dataset_size", dataset_size, minimum=1)
        self._b = _int("batch_size", batch_size, minimum=1)
        if self._b > self._n:
            raise ConfigurationError(
                f"batch_size={self._b} exceeds dataset_size={self._n}: expected B ≤ N"
            )
        if not isinstance(drop_last, bool):
            raise InputTypeError(f"drop_last={drop_last!r}: expected True or False")
        self._drop_last = drop_last
        steps = self._n // self._b if drop_last else math.ceil(self._n / self._b)
        r, size = _sharding(rank, world_size)
        super().__init__(steps, _source(randomness, seed, size, "ShuffleSampler"), r, size)
        warnings.warn(
            "ShuffleSampler draws fixed-size batches from a shuffle, not Poisson batches: the ε "
            "of opake.accounting (which assumes Poisson sampling at rate q) does not hold for "
            "it; use PoissonSampler or FixedShapePoissonSampler for private training",
            OpakePrivacyWarning,
            stacklevel=2,
        )

    @property
    def batch_size(self) -> int:
        return self._b

    @property
    def dataset_size(self) -> int:
        return self._n

    def global_batch(self, step: int) -> np.ndarray:
        """Indices of the global batch of ``step`` (identical on every rank)."""
        step = _int("step", step, minimum=0)
        epoch, index = divmod(step, self._steps_per_epoch)
        perm = self._source.sort_keys("shuffle", epoch, self._n)
        return perm[index * self._b : (index + 1) * self._b]

    def _batch(self, step: int) -> list[int]:
        batch: list[int] = self.global_batch(step)[self._rank :: self._world_size].tolist()
        return batch

    def _config(self) -> dict[str, Any]:
        return {"dataset_size": self._n, "batch_size": self._b, "drop_last": self._drop_last}
