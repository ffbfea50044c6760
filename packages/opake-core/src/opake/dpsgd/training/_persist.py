"""The state of a :class:`~opake.dpsgd.training.DPTraining`: its dict, its checkpoint file.

The settings that decide the privacy accounting (N, q, δ, target ε, secure or seeded) are saved
with the state and must match on resume. The pending clipped sum of a logical step in progress
is un-noised private data and is never saved.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, OperationError

if TYPE_CHECKING:
    import os

    from opake.dpsgd.training._dp_training import DPTraining

_STATE_VERSION = 1
_CONFIG_KEY = "opake.training"


def _config(training: DPTraining) -> dict[str, Any]:
    return {
        "dataset_size": training.dataset_size,
        "sample_rate": training.sample_rate,
        "delta": training.delta,
        "target_epsilon": training.target_epsilon,
        "world_size": training.world_size,
        "secure": training.secure,
    }


def _check_config(training: DPTraining, saved: Any) -> None:
    if not isinstance(saved, Mapping):
        raise ConfigurationError("the saved training state has no configuration")
    mine = _config(training)
    diffs = [
        f"{key} {saved.get(key)!r} (saved) vs {value!r} (now)"
        for key, value in mine.items()
        if key != "world_size" and saved.get(key) != value
    ]
    if diffs:
        raise ConfigurationError(
            "the saved training state was made with other settings: "
            + "; ".join(diffs)
            + "; resume with the saved settings (they decide the privacy accounting)"
        )


def _state_dict(training: DPTraining) -> dict[str, Any]:
    if training._pending_aux:
        raise OperationError(
            "state_dict() in the middle of a logical step: call finish_step() first (the "
            "pending clipped sum is un-noised private data and is never saved)"
        )
    sampler = training._sampler.state_dict()
    sampler["position"] = training.steps
    return {
        "version": _STATE_VERSION,
        "config": _config(training),
        "optimizer": training._optimizer.state_dict(),
        "accountant": training._accountant.state_dict(),
        "sampler": sampler,
        "clip_state": training._clip_state.to_dict(),
    }


def _load_state_dict(training: DPTraining, state: Mapping[str, Any]) -> None:
    from opake.dpsgd.clipping import clip_state_from_dict

    if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
        raise ConfigurationError(
            "expected the dict from DPTraining.state_dict() (version "
            f"{_STATE_VERSION}); got {type(state).__name__}"
        )
    _check_config(training, state.get("config"))
    clip = clip_state_from_dict(state["clip_state"])
    training._optimizer.load_state_dict(state["optimizer"])
    training._accountant.load_state_dict(state["accountant"])
    training._sampler.load_state_dict(state["sampler"])
    training._clip_state = clip
    training._after_load()


def _save(
    training: DPTraining,
    path: str | os.PathLike[str],
    *,
    model: Any,
    extra: Mapping[str, Any] | None,
    rng: bool,
    collective: bool,
) -> Path:
    from opake.dpsgd.checkpoint import save_checkpoint
    from opake.dpsgd.distributed import save_checkpoint_distributed

    if training._pending_aux:
        raise OperationError(
            "save() in the middle of a logical step: call finish_step() first (the pending "
            "clipped sum is un-noised private data and is never saved)"
        )
    payload = dict(extra or {})
    if _CONFIG_KEY in payload:
        raise ConfigurationError(f"extra key {_CONFIG_KEY!r} is reserved")
    payload[_CONFIG_KEY] = _config(training)
    sampler = training._sampler
    position = sampler.position
    sampler.seek(training.steps)  # a prefetching loader may have drawn ahead
    common = {
        "step": training.steps,
        "model": model,
        "optimizer": training._optimizer,
        "accountant": training._accountant,
        "sampler": sampler,
        "clip_state": training._clip_state,
        "extra": payload,
        "rng": rng,
    }
    try:
        if not collective:
            return save_checkpoint(path, **common)
        return save_checkpoint_distributed(path, group=training._context.group, **common)
    finally:
        sampler.seek(position)


def _load(
    training: DPTraining,
    path: str | os.PathLike[str],
    *,
    model: Any,
    rng: bool,
    collective: bool,
) -> dict[str, Any]:
    from opake.dpsgd.checkpoint import load_checkpoint
    from opake.dpsgd.distributed import load_checkpoint_distributed

    common = {
        "model": model,
        "optimizer": training._optimizer,
        "accountant": training._accountant,
        "sampler": training._sampler,
        "clip_state": training._clip_state,
        "rng": rng,
        "strict": model is not None,
    }
    if collective:
        ckpt = load_checkpoint_distributed(path, group=training._context.group, **common)
    else:
        ckpt = load_checkpoint(path, **common)
    extra = dict(ckpt.extra)
    config = extra.pop(_CONFIG_KEY, None)
    if config is not None:
        _check_config(training, config)
    # else: a checkpoint of the same components written without DPTraining (e.g. an
    # earlier opake train): the optimizer, sampler and accountant were each validated and
    # restored above (a file without an accountant is refused), so nothing is forgotten
    if ckpt.clip_state is not None:
        training._clip_state = ckpt.clip_state
    training._after_load()
    return extra
