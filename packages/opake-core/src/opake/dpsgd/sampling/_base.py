"""Batch samplers for DP-SGD (implementation of :mod:`opake.dpsgd.sampling`).

Every batch is a pure function of ``(key, step)``: each draw comes from the ChaCha20 keystream
of the sampler's :class:`~opake.dpsgd.randomness.Randomness` at index ``step`` (a secure key
from the operating system by default; a key derived from ``seed=`` when reproducibility is
asked for). So a resumed sampler only needs its position, and every rank given the same key
draws the same *global* batch and keeps its own shard of it.
"""

from __future__ import annotations

import hashlib
import logging
import numbers
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import Any

from opake.core.errors import ConfigurationError, InputTypeError
from opake.dpsgd.randomness._resolve import resolve_randomness
from opake.dpsgd.randomness._source import Randomness, check_seed

#: Index that :class:`FixedShapePoissonSampler` puts in padding slots.
PADDING_INDEX = -1

_LOG = logging.getLogger("opake.core")
_RESAMPLE_LABEL = b"opake.sampling.resample.v1:"

_STATE_VERSION = 2
#: how many recently handed-out batches keep their size (a prefetching loader runs a few ahead)
_HANDED = 16


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


def _poisson_base(
    owner: str,
    q: float,
    steps_per_epoch: object,
    keys: tuple[object, object],
    shard: tuple[object, object],
) -> tuple[int, Randomness, int, int]:
    """``_BaseSampler``'s arguments for a Poisson sampler at rate *q*: batches per epoch
    (default ``round(1/q)``), the random source from ``keys = (randomness, seed)``, and
    ``shard = (rank, world_size)`` checked."""
    steps = (
        max(1, round(1.0 / q))
        if steps_per_epoch is None
        else _int("steps_per_epoch", steps_per_epoch, minimum=1)
    )
    r, size = _sharding(*shard)
    return steps, _source(keys[0], keys[1], size, owner), r, size


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
        self._drawn = 0  # steps [0, _drawn) were handed out under the current key
        self._rekeys = 0
        self._handed: dict[int, int] = {}  # step -> real indices of a batch handed out lately

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
            self._never_again(self._position)
            batch = self._batch(self._position)
            self._handed[self._position] = len(batch) - batch.count(PADDING_INDEX)
            if len(self._handed) > _HANDED:
                del self._handed[min(self._handed)]
            self._position += 1
            self._drawn = max(self._drawn, self._position)
            yield batch

    def _never_again(self, step: int) -> None:
        """A secure sampler moved back (``seek``, ``load_state_dict``) to a step it has handed
        out draws that step from a key derived from its own: a batch already given — perhaps
        trained on — is never given again (the accountant counts every step as a fresh Poisson
        draw; a replayed batch would not be one). Every rank that moves back the same way
        derives the same key; a seeded sampler replays by design."""
        if not self.secure or step >= self._drawn:
            return
        self._rekeys += 1
        material = _RESAMPLE_LABEL + self._source.export_key() + self._rekeys.to_bytes(8, "little")
        self._source = Randomness.from_key(hashlib.sha256(material).digest())
        self._handed.clear()
        _LOG.info(
            "%s: step %d was already drawn (the sampler moved back to it); steps from %d on are "
            "drawn from a new key derived from the sampler's own (secure samplers never repeat "
            "a batch)",
            type(self).__name__,
            step,
            step,
        )
        self._drawn = step

    def batch_at(self, step: int) -> list[int]:
        """This rank's indices of batch ``step``, exactly as iteration yields them, without
        moving the position (or counting anything): a pure function of the key and the step.

        A training loop can check with it that a batch it is given is the one the sampler
        drew for that step (``DPTrainer`` does, for every physical batch).
        """
        return self._batch(_int("step", step, minimum=0))

    def drawn_count(self, step: int) -> int:
        """How many examples this rank's batch ``step`` holds (padding slots excluded): what a
        step may sum at most. Remembered for the last batches handed out, else drawn again
        (:meth:`batch_at`).

        >>> from opake.dpsgd.sampling import FixedShapePoissonSampler
        >>> sampler = FixedShapePoissonSampler(100, 0.05, max_batch_size=12, seed=0)
        >>> batch = next(iter(sampler))
        >>> sampler.drawn_count(0) == len(batch) - batch.count(PADDING_INDEX)
        True
        """
        count = self._handed.get(step)
        if count is None:
            batch = self.batch_at(step)
            count = len(batch) - batch.count(PADDING_INDEX)
        return count

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

    def _check_extra_state(self, state: Mapping[str, Any]) -> None:
        """Raise what :meth:`_load_extra_state` would refuse ``state`` for (nothing here)."""
        del state

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        return None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` at the saved position. A seeded sampler takes the
        saved seed, so the next batch equals the one the uninterrupted sampler would have
        produced; a secure one keeps its own fresh key (the saved one was never stored). The
        configuration must match (the rank and world size may differ: the global sequence does
        not depend on them). Validated first (:meth:`check_state_dict`): nothing changes on
        error."""
        position = self.check_state_dict(state)
        if not self.secure:
            self._source = Randomness.seeded(check_seed(state["seed"]))
        self._handed.clear()
        self._position = position
        self._load_extra_state(state)

    def check_state_dict(self, state: Mapping[str, Any]) -> int:
        """Raise what :meth:`load_state_dict` would refuse ``state`` for, changing nothing;
        returns the saved position (a checkpoint loader checks every part before restoring
        any)."""
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
            check_seed(state["seed"])
        self._check_extra_state(state)
        return position

    def __repr__(self) -> str:
        shard = f", rank={self._rank}/{self._world_size}" if self._world_size > 1 else ""
        return f"{type(self).__name__}({self._config()}{shard}, position={self._position})"
