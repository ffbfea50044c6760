"""The state of a :class:`~opake.dpsgd.training.DPTraining`: its dict, its checkpoint file.

The settings that decide the privacy accounting (N, q, δ, target ε, secure or seeded) are saved
with the state and must match on resume. The pending clipped sum of a logical step in progress
is un-noised private data and is never saved.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, OperationError
from opake.dpsgd.training._resume import CONFIG_KEY, check_config, check_file_together, check_state
from opake.dpsgd.training._views import TrainingViews

if TYPE_CHECKING:
    import os

    from opake.dpsgd.checkpoint import Checkpoint
    from opake.dpsgd.clipping import ClipState

_STATE_VERSION = 1


@dataclass(frozen=True)
class Parts:
    """What persistence reads and restores of a :class:`DPTraining`: its components, read
    through its public views (:func:`parts_of`), never its private state.

    ``config``: the settings that decide the accounting (:func:`config_of`); ``pending``:
    physical batches are accumulated and not yet stepped; ``group``: the process group of a
    collective save or load; ``sharded``: the ``fully_shard``-ed module (``shard=True``).
    """

    config: dict[str, Any]
    noise_multiplier: float
    steps: int
    pending: bool
    optimizer: Any
    accountant: Any
    sampler: Any
    clip_state: Any
    group: Any
    sharded: Any = None


def parts_of(training: TrainingViews) -> Parts:
    """The components of ``training`` persistence saves and restores, read through its public
    views."""
    return Parts(
        config=config_of(training),
        noise_multiplier=training.noise_multiplier,
        steps=training.steps,
        pending=training.pending_batches > 0,
        optimizer=training.optimizer,
        accountant=training.accountant,
        sampler=training.sampler,
        clip_state=training.clip_state,
        group=training.process_group,
        sharded=training.sharded_module,
    )


def config_of(training: TrainingViews) -> dict[str, Any]:
    """The settings that decide the privacy accounting, from the training's public views."""
    return {
        "dataset_size": training.dataset_size,
        "sample_rate": training.sample_rate,
        "delta": training.delta,
        "target_epsilon": training.target_epsilon,
        "world_size": training.world_size,
        "secure": training.secure,
    }


#: why a sharded training has no state dict (its state is one shard per rank)
_SHARDED = (
    "with shard=True: each rank holds its shards of the parameters and optimizer state; use "
    "save(directory) / load(directory) (save_sharded_checkpoint: every rank writes its shards)"
)


def state_dict(parts: Parts) -> dict[str, Any]:
    """``DPTraining.state_dict()`` (refused while physical batches are pending)."""
    if parts.sharded is not None:
        raise OperationError(f"state_dict() {_SHARDED}")
    if parts.pending:
        raise OperationError(
            "state_dict() in the middle of a logical step: call finish_step() first (the "
            "pending clipped sum is un-noised private data and is never saved)"
        )
    sampler = parts.sampler.state_dict()
    sampler["position"] = parts.steps
    return {
        "version": _STATE_VERSION,
        "config": parts.config,
        "optimizer": parts.optimizer.state_dict(),
        "accountant": parts.accountant.state_dict(),
        "sampler": sampler,
        "clip_state": parts.clip_state.to_dict(),
    }


def load_state_dict(parts: Parts, state: Mapping[str, Any]) -> ClipState:
    """Restore ``DPTraining.state_dict()`` into the components; returns the clip state the
    training takes (validated before anything is restored)."""
    from opake.dpsgd.clipping import clip_state_from_dict

    if parts.sharded is not None:
        raise OperationError(f"load_state_dict() {_SHARDED}")
    if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
        raise ConfigurationError(
            "expected the dict from DPTraining.state_dict() (version "
            f"{_STATE_VERSION}); got {type(state).__name__}"
        )
    check_config(parts.config, state.get("config"))
    clip = clip_state_from_dict(state["clip_state"])
    check_state(
        parts, optimizer=state.get("optimizer"), accountant=state.get("accountant"), clip=clip
    )
    # nothing restored until every component has checked its state
    for key in ("sampler", "optimizer", "accountant"):
        check = getattr(getattr(parts, key), "check_state_dict", None)
        if callable(check):
            check(state[key])
    # the optimizer first: the wrapped torch optimizer's restore may still fail, changing nothing
    parts.optimizer.load_state_dict(state["optimizer"])
    parts.sampler.load_state_dict(state["sampler"])
    parts.accountant.load_state_dict(state["accountant"])
    return clip


def save(
    parts: Parts,
    path: str | os.PathLike[str],
    *,
    model: Any,
    extra: Mapping[str, Any] | None,
    rng: bool,
    collective: bool,
) -> Path:
    """``DPTraining.save()``: the components (and ``model``) written atomically."""
    from opake.dpsgd.checkpoint import save_checkpoint
    from opake.dpsgd.distributed import save_checkpoint_distributed

    if parts.pending:
        raise OperationError(
            "save() in the middle of a logical step: call finish_step() first (the pending "
            "clipped sum is un-noised private data and is never saved)"
        )
    payload = dict(extra or {})
    if CONFIG_KEY in payload:
        raise ConfigurationError(f"extra key {CONFIG_KEY!r} is reserved")
    payload[CONFIG_KEY] = parts.config
    sampler = parts.sampler
    position = sampler.position
    sampler.seek(parts.steps)  # a prefetching loader may have drawn ahead
    common = {
        "step": parts.steps,
        "model": model,
        "optimizer": parts.optimizer,
        "accountant": parts.accountant,
        "sampler": sampler,
        "clip_state": parts.clip_state,
        "extra": payload,
        "rng": rng,
    }
    try:
        if parts.sharded is not None:
            return save_sharded(parts, path, common, collective=collective)
        if not collective:
            return save_checkpoint(path, **common)
        return save_checkpoint_distributed(path, group=parts.group, **common)
    finally:
        sampler.seek(position)


def _check_sharded(parts: Parts, model: Any, collective: bool, what: str) -> None:
    if not collective:
        raise ConfigurationError(
            f"{what}(collective=False) with shard=True: every rank writes and reads its own "
            "shards; call it on every rank with collective=True"
        )
    if model is not None and model is not parts.sharded:
        raise ConfigurationError(
            f"{what}(model=...) with shard=True: the sharded module is saved with the state; "
            "drop model= (or pass the training's own module)"
        )


def save_sharded(
    parts: Parts, path: str | os.PathLike[str], common: dict[str, Any], *, collective: bool
) -> Path:
    """``save()`` of a sharded training: a directory (``save_sharded_checkpoint``)."""
    from opake.dpsgd.distributed import save_sharded_checkpoint

    _check_sharded(parts, common.pop("model"), collective, "save")
    return save_sharded_checkpoint(path, model=parts.sharded, **common)


def load_sharded(
    parts: Parts, path: str | os.PathLike[str], *, model: Any, rng: bool, collective: bool
) -> Checkpoint:
    """``load()`` of a sharded training (``load_sharded_checkpoint``); returns the checkpoint."""
    from opake.dpsgd.distributed import load_sharded_checkpoint

    _check_sharded(parts, model, collective, "load")
    return load_sharded_checkpoint(
        path,
        model=parts.sharded,
        optimizer=parts.optimizer,
        accountant=parts.accountant,
        sampler=parts.sampler,
        clip_state=parts.clip_state,
        rng=rng,
    )


def load(
    parts: Parts,
    path: str | os.PathLike[str],
    *,
    model: Any,
    rng: bool,
    collective: bool,
) -> tuple[dict[str, Any], ClipState | None]:
    """``DPTraining.load()``: restore the components; returns the saved ``extra`` and the clip
    state the training takes (``None``: keep its own)."""
    from opake.dpsgd.checkpoint import load_checkpoint
    from opake.dpsgd.distributed import load_checkpoint_distributed

    common = {
        "model": model,
        "optimizer": parts.optimizer,
        "accountant": parts.accountant,
        "sampler": parts.sampler,
        "clip_state": parts.clip_state,
        "rng": rng,
        "strict": model is not None,
    }
    check_file_together(parts, Path(path), collective=collective)
    if parts.sharded is not None:
        ckpt = load_sharded(parts, path, model=model, rng=rng, collective=collective)
    elif collective:
        ckpt = load_checkpoint_distributed(path, group=parts.group, **common)
    else:
        ckpt = load_checkpoint(path, **common)
    extra = dict(ckpt.extra)
    extra.pop(CONFIG_KEY, None)  # checked before the restore (check_file)
    return extra, ckpt.clip_state


class TrainingState(TrainingViews, abc.ABC):
    """``DPTraining``'s persistence: its state dict and checkpoint file (an abstract base
    class, read through the public views; the step restores itself in :meth:`_after_load`)."""

    _clip_state: ClipState

    @abc.abstractmethod
    def _after_load(self) -> None:
        """Called once the components are restored: drop any step in progress and line the
        sampler up with the restored step count (the subclass owns the step's state)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs besides the model: optimizer, noise generator, sampler
        position (= logical steps taken), accountant history, clipping state.

        Refused while physical batches are pending (their un-noised sum is never saved).
        """
        return state_dict(parts_of(self))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; the next step equals the uninterrupted run's (seeded).

        Refused (:class:`~opake.core.errors.ConfigurationError`, nothing restored) when the
        state was made with other privacy settings, another noise multiplier σ (a σ calibrated
        from ``target_epsilon`` for another number of ``steps`` included), or another
        clipping: another method, or the same method with other settings (an adaptive C's
        moved bound is taken); and when the state disagrees with itself (an accountant that
        recorded fewer steps than its optimizer took, an adaptive count noise not accounted
        or whose index this training's key has already given).
        """
        self._clip_state = load_state_dict(parts_of(self), state)
        self._after_load()

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        model: Any = None,
        extra: Mapping[str, Any] | None = None,
        rng: bool = True,
        collective: bool = True,
    ) -> Path:
        """Write the training state (and ``model``, if given) atomically to ``path``.

        Every rank calls it under ``torch.distributed``; rank 0 writes (see
        ``save_checkpoint_distributed``). With ``shard=True``, ``path`` is a directory: every
        rank writes its shards of the module and optimizer state
        (:func:`~opake.dpsgd.distributed.save_sharded_checkpoint`; resume on the same world
        size). With ``collective=False`` this process writes alone
        (no collective: call it on one rank only; the state is the same on every rank).
        ``extra``: plain values returned by :meth:`load`.
        """
        parts = parts_of(self)
        return save(parts, path, model=model, extra=extra, rng=rng, collective=collective)

    def load(
        self,
        path: str | os.PathLike[str],
        *,
        model: Any = None,
        rng: bool = True,
        collective: bool = True,
    ) -> dict[str, Any]:
        """Restore what :meth:`save` wrote (every rank); returns the saved ``extra``.

        ``collective=False`` reads without collectives (each rank may call it on its own).
        Refused as :meth:`load_state_dict` is when the file was made with other privacy,
        noise or clipping settings; with ``collective=True`` under a process group, a file
        refused on any rank makes every rank raise before anything is restored.
        """
        extra, clip = load(parts_of(self), path, model=model, rng=rng, collective=collective)
        if clip is not None:
            self._clip_state = clip
        self._after_load()
        return extra
