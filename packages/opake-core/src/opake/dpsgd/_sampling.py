"""Batch samplers for DP-SGD (implementation of :mod:`opake.dpsgd.sampling`).

Every batch is a pure function of ``(key, step)``: each draw comes from the ChaCha20 keystream
of the sampler's :class:`~opake.dpsgd.randomness.Randomness` at index ``step`` (a secure key
from the operating system by default; a key derived from ``seed=`` when reproducibility is
asked for). So a resumed sampler only needs its position, and every rank given the same key
draws the same *global* batch and keeps its own shard of it.
"""

from __future__ import annotations

import math
import numbers
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from opake.accounting import truncation_probability
from opake.core.errors import ConfigurationError, InputTypeError, OpakePrivacyWarning
from opake.dpsgd._randomness import Randomness, check_seed, resolve_randomness

if TYPE_CHECKING:
    import torch

__all__ = [
    "PADDING_INDEX",
    "EmptyBatchCollate",
    "FixedShapePoissonSampler",
    "PaddedDataset",
    "PoissonSampler",
    "ShuffleSampler",
    "padding_mask",
]

#: Index that :class:`FixedShapePoissonSampler` puts in padding slots.
PADDING_INDEX = -1

_STATE_VERSION = 2


def _int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputTypeError(f"{name}={value!r} ({type(value).__name__}): expected an int")
    number = int(value)
    if number < minimum:
        raise ConfigurationError(f"{name}={number}: expected an int ≥ {minimum}")
    return number


def _rate(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputTypeError(
            f"sample_rate={value!r} ({type(value).__name__}): expected a float in (0, 1]"
        )
    q = float(value)
    if not 0.0 < q <= 1.0:
        raise ConfigurationError(
            f"sample_rate={value!r}: expected a Poisson rate in (0, 1] (expected batch size / "
            "dataset size)"
        )
    return q


def _source(randomness: object, seed: object, world_size: int, owner: str) -> Randomness:
    if randomness is None and seed is None and world_size > 1:
        raise ConfigurationError(
            f"{owner} with world_size={world_size} and neither randomness= nor seed=: every rank "
            "must draw the same global batch, so give every rank the same key — "
            "randomness=shared_randomness() from opake.dpsgd.distributed (secure), or the same "
            "seed= (reproducible, not private)"
        )
    return resolve_randomness(randomness, seed, owner=owner)


def _sharding(rank: object, world_size: object) -> tuple[int, int]:
    size = _int("world_size", world_size, minimum=1)
    r = _int("rank", rank, minimum=0)
    if r >= size:
        raise ConfigurationError(f"rank={r} with world_size={size}: expected 0 ≤ rank < world_size")
    return r, size


class _BaseSampler(ABC):
    """Position bookkeeping, epochs and state shared by the samplers."""

    _kind: str

    def __init__(
        self, steps_per_epoch: int, source: Randomness, rank: int, world_size: int
    ) -> None:
        self._steps_per_epoch = steps_per_epoch
        self._source = source
        self._rank = rank
        self._world_size = world_size
        self._position = 0

    @property
    def seed(self) -> int | None:
        """The seed of a reproducible (not private) sampler; ``None`` when secure."""
        return self._source.seed

    @property
    def randomness(self) -> Randomness:
        """The random source of the batches (the same key on every rank)."""
        return self._source

    @property
    def secure(self) -> bool:
        """Whether batch membership comes from a secure key (nothing stored replays it)."""
        return self._source.is_secure

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def position(self) -> int:
        """Number of batches handed out so far (over all epochs): the next batch's step."""
        return self._position

    def seek(self, position: int) -> None:
        """Make the next batch the one of global step ``position`` (e.g. the steps trained).

        A ``DataLoader`` with workers asks its sampler for a few batches ahead, so a checkpoint
        should record the number of steps actually trained and ``seek`` to it on resume.
        """
        self._position = _int("position", position, minimum=0)

    def __len__(self) -> int:
        """Batches per epoch (one pass of ``iter``)."""
        return self._steps_per_epoch

    @property
    def epoch(self) -> int:
        """Current epoch (position // batches per epoch)."""
        return self._position // self._steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        end = (self._position // self._steps_per_epoch + 1) * self._steps_per_epoch
        while self._position < end:
            batch = self._batch(self._position)
            self._position += 1
            yield batch

    @abstractmethod
    def _batch(self, step: int) -> list[int]:
        """The indices of batch *step* (a pure function of the key and the step)."""

    @abstractmethod
    def _config(self) -> dict[str, Any]:
        """The constructor settings, for ``state_dict`` validation."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: the mode, the seed (seeded only), the position and the
        configuration. A secure key is never part of it."""
        return {
            "kind": self._kind,
            "version": _STATE_VERSION,
            "secure": self.secure,
            "seed": self.seed,
            "position": self._position,
            "config": self._config(),
            **self._extra_state(),
        }

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        return None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` at the saved position. A seeded sampler takes the
        saved seed, so the next batch equals the one the uninterrupted sampler would have
        produced; a secure one keeps its own fresh key (the saved one was never stored). The
        configuration must match (the rank and world size may differ: the global sequence does
        not depend on them)."""
        if not isinstance(state, Mapping):
            raise InputTypeError(f"state={type(state).__name__}: expected a mapping")
        for key in ("kind", "version", "secure", "seed", "position", "config"):
            if key not in state:
                raise ConfigurationError(
                    f"sampler state lacks {key!r}: pass the sampler's state_dict() output"
                )
        if state["kind"] != self._kind:
            raise ConfigurationError(
                f"sampler state of kind {state['kind']!r} loaded into a {self._kind!r} sampler"
            )
        if state["version"] != _STATE_VERSION:
            raise ConfigurationError(
                f"sampler state version {state['version']!r}: this Opake reads {_STATE_VERSION}"
            )
        config = dict(state["config"])
        if config != self._config():
            raise ConfigurationError(
                f"sampler state was saved with {config} but this sampler has {self._config()}; "
                "resuming with a different dataset size, rate or batch shape would change the "
                "privacy accounting — rebuild the sampler with the saved configuration"
            )
        if bool(state["secure"]) != self.secure:
            raise ConfigurationError(
                f"sampler state is {'secure' if state['secure'] else 'seeded'} but this sampler "
                f"is {self._source.mode}; build it the same way (seed= for a seeded run, no seed "
                "for a secure one)"
            )
        position = _int("position", state["position"], minimum=0)
        if not self.secure:
            self._source = Randomness.seeded(check_seed(state["seed"]))
        self._position = position
        self._load_extra_state(state)

    def __repr__(self) -> str:
        shard = f", rank={self._rank}/{self._world_size}" if self._world_size > 1 else ""
        return f"{type(self).__name__}({self._config()}{shard}, position={self._position})"


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
        steps = (
            max(1, round(1.0 / self._q))
            if steps_per_epoch is None
            else _int("steps_per_epoch", steps_per_epoch, minimum=1)
        )
        r, size = _sharding(rank, world_size)
        super().__init__(steps, _source(randomness, seed, size, type(self).__name__), r, size)

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
        return self.global_batch(step)[self._rank :: self._world_size].tolist()

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
        return slots[self._rank :: self._world_size].tolist()

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), "max_batch_size": self._b_max}

    def _extra_state(self) -> dict[str, Any]:
        return {"truncated_steps": self._truncated}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        self._truncated = _int("truncated_steps", state.get("truncated_steps", 0), minimum=0)


class ShuffleSampler(_BaseSampler):
    """Fixed-size batches from a seeded shuffle per epoch (sampling without replacement).

    **Not Poisson sampling.** Opake's accountants compute ε for Poisson sampling at rate q;
    that figure does not hold for shuffled fixed-size batches (the privacy amplification of
    shuffling is different and weaker in general), so constructing this sampler emits an
    :class:`~opake.core.errors.OpakePrivacyWarning`. Use it for non-private baselines and
    debugging, or with an accounting you do yourself.

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
        return self.global_batch(step)[self._rank :: self._world_size].tolist()

    def _config(self) -> dict[str, Any]:
        return {"dataset_size": self._n, "batch_size": self._b, "drop_last": self._drop_last}


def padding_mask(batch: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Bool tensor: True for real examples, False for :data:`PADDING_INDEX` slots.

    Example:
        >>> padding_mask([4, 9, PADDING_INDEX]).tolist()
        [True, True, False]
    """
    import torch

    indices = torch.as_tensor(batch, dtype=torch.int64)
    return indices != PADDING_INDEX


class PaddedDataset:
    """Map-style dataset wrapper for :class:`FixedShapePoissonSampler`: ``(example, is_real)``.

    ``dataset[i]`` becomes ``(dataset[i], True)``; the padding index becomes
    ``(dataset[filler_index], False)`` — a real example used only for its shape, whose
    contribution the training step must mask to zero. The default collate then yields
    ``(batch, mask)`` with ``mask`` a bool tensor of shape ``(slots,)``.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> data = TensorDataset(torch.arange(10.0))
        >>> sampler = FixedShapePoissonSampler(10, 0.2, max_batch_size=6, seed=1)
        >>> (x,), mask = next(iter(DataLoader(PaddedDataset(data), batch_sampler=sampler)))
        >>> x.shape, mask.tolist()
        (torch.Size([6]), [True, True, False, False, False, False])
    """

    def __init__(self, dataset: Any, filler_index: int = 0) -> None:
        if not hasattr(dataset, "__getitem__"):
            raise InputTypeError(
                f"dataset={type(dataset).__name__}: expected a map-style dataset (__getitem__)"
            )
        self.dataset = dataset
        self.filler_index = _int("filler_index", filler_index, minimum=0)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, bool]:
        if index == PADDING_INDEX:
            return self.dataset[self.filler_index], False
        if index < 0:
            raise ConfigurationError(
                f"index {index}: negative indices other than PADDING_INDEX={PADDING_INDEX} "
                "are not dataset positions"
            )
        return self.dataset[index], True


class EmptyBatchCollate:
    """A collate function that also handles the empty batches Poisson sampling produces.

    Non-empty batches go to ``collate_fn`` (default: torch's ``default_collate``). An empty
    batch returns the collated structure of one example (``dataset[0]``) with every tensor cut
    to length 0 along the batch dimension, so ``x.shape == (0, *example_shape)`` flows through
    the model and ``clipped_grad`` returns zero gradients (the step still adds noise).

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> data = TensorDataset(torch.zeros(5, 3), torch.zeros(5, dtype=torch.long))
        >>> x, y = EmptyBatchCollate(data)([])
        >>> tuple(x.shape), tuple(y.shape), y.dtype
        ((0, 3), (0,), torch.int64)
    """

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None = None) -> None:
        if not hasattr(dataset, "__getitem__"):
            raise InputTypeError(
                f"dataset={type(dataset).__name__}: expected a map-style dataset (__getitem__)"
            )
        if collate_fn is not None and not callable(collate_fn):
            raise InputTypeError(f"collate_fn={collate_fn!r}: expected a callable")
        self.dataset = dataset
        self.collate_fn = collate_fn
        self._template: Any = None

    def _collate(self, batch: list[Any]) -> Any:
        if self.collate_fn is not None:
            return self.collate_fn(batch)
        from torch.utils.data import default_collate

        return default_collate(batch)

    def __call__(self, batch: list[Any]) -> Any:
        if len(batch):
            return self._collate(batch)
        if self._template is None:
            if len(self.dataset) == 0:
                raise ConfigurationError("an empty dataset has no example to shape empty batches")
            self._template = self._collate([self.dataset[0]])
        return _emptied(self._template)


def _emptied(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value[:0].clone()
    if isinstance(value, Mapping):
        return type(value)({k: _emptied(v) for k, v in value.items()})  # type: ignore[call-arg]
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_emptied(v) for v in value))
    if isinstance(value, tuple | list):
        # A list of collated fields (tensors, dicts, …) keeps its structure; a list of plain
        # values (strings, ids) is itself the batch, so it becomes empty.
        if value and all(isinstance(v, torch.Tensor | Mapping | tuple | list) for v in value):
            return type(value)(_emptied(v) for v in value)
        return type(value)()
    return value
