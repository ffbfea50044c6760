"""Save and load the whole DP training state (implementation of :mod:`opake.dpsgd.checkpoint`).

:func:`save_checkpoint` encodes each component, checks that it is plain data and writes the file
atomically; :func:`load_checkpoint` reads and validates the file and every component before
restoring any of them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from opake.core.errors import InputTypeError
from opake.dpsgd.checkpoint._components import (
    _decode_value,
    _encode_value,
    _loader,
    _model_state,
    _restore_model,
    _restore_rng,
    _rng_state,
    _self_describing,
    _stateful,
)
from opake.dpsgd.checkpoint._file import (
    _STATEFUL,
    FORMAT,
    VERSION,
    CheckpointError,
    _check_plain,
    _read,
    atomic_write,
)

__all__ = [
    "Checkpoint",
    "checkpoint_step",
    "load_checkpoint",
    "prepare_load",
    "save_checkpoint",
]


@dataclass(frozen=True)
class Checkpoint:
    """What :func:`load_checkpoint` read (the live objects passed to it are restored in place).

    Attributes:
        path: the file read.
        step: the training step recorded at save time.
        clip_state: the clipping state (``None`` when the file has none).
        extra: the user's ``extra`` dict.
        components: names of the components stored in the file.
    """

    path: Path
    step: int
    clip_state: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    components: tuple[str, ...] = ()


def _write_payload(payload: dict[str, Any], handle: IO[bytes]) -> None:
    import torch

    torch.save(payload, handle)


def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    step: int,
    model: Any = None,
    optimizer: Any = None,
    accountant: Any = None,
    sampler: Any = None,
    clip_state: Any = None,
    extra: Mapping[str, Any] | None = None,
    rng: bool = True,
) -> Path:
    """Write the whole training state to ``path`` atomically (see :func:`atomic_write`).

    Args:
        path: destination file; its directory must exist.
        step: the training step reached (returned by :func:`load_checkpoint`).
        model: an ``nn.Module`` (parameters and buffers) or a ``name -> tensor`` dict.
        optimizer: a :class:`~opake.dpsgd.optimizer.DPOptimizer` (wrapped optimizer, noise
            generator, step count) or any object with ``state_dict``/``load_state_dict``.
        accountant: the privacy accountant (its full history).
        sampler: the batch sampler (its RNG and position).
        clip_state: the clipping state returned by the last ``grad_fn`` call.
        extra: user data (tensors and plain values only), returned as ``Checkpoint.extra``.
        rng: also save the global torch / numpy / Python RNG states (dropout, data order).

    Example:
        >>> import pathlib, tempfile, torch
        >>> from opake.dpsgd.checkpoint import load_checkpoint, save_checkpoint
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "run.pt"
        >>> net = torch.nn.Linear(2, 1)
        >>> _ = save_checkpoint(path, step=7, model=net)
        >>> load_checkpoint(path, model=torch.nn.Linear(2, 1)).step
        7
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InputTypeError(f"step={step!r}: expected an int ≥ 0 (the training step reached)")
    if extra is not None and not isinstance(extra, Mapping):
        raise InputTypeError(f"extra={type(extra).__name__}: expected a dict of plain values")
    components: dict[str, Any] = {}
    if model is not None:
        components["model"] = _model_state(model)
    for name, obj in (("optimizer", optimizer), ("accountant", accountant), ("sampler", sampler)):
        if obj is not None:
            components[name] = _stateful(name, obj)
    if clip_state is not None:
        components["clip_state"] = _encode_value(clip_state)
    if rng:
        components["rng"] = _rng_state()
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "components": components,
        "extra": dict(extra or {}),
    }
    for name, value in components.items():
        _check_plain(value, f"checkpoint component {name!r}")
    _check_plain(payload["extra"], "extra")
    return atomic_write(path, lambda handle: _write_payload(payload, handle))


def checkpoint_step(path: str | os.PathLike[str]) -> int:
    """The step ``path`` was saved at, read and validated without restoring anything.

    Check a checkpoint against something else before :func:`load_checkpoint` changes the live
    objects (which cannot be undone: a restored accountant refuses to be rewound).

    >>> import pathlib, tempfile, torch
    >>> from opake.dpsgd.checkpoint import checkpoint_step, save_checkpoint
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "ckpt.pt"
    >>> checkpoint_step(save_checkpoint(path, step=5, model=torch.nn.Linear(2, 1)))
    5

    Raises:
        CheckpointError: unreadable, damaged or foreign file.
    """
    # memory-mapped: the header is read, not the tensors (a caller loads the file next)
    step: int = _read(Path(path), "cpu", mmap=True)["step"]
    return step


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: Any = None,
    optimizer: Any = None,
    accountant: Any = None,
    sampler: Any = None,
    clip_state: Any = None,
    rng: bool = True,
    strict: bool = True,
    map_location: Any = "cpu",
) -> Checkpoint:
    """Read ``path``, validate it, and restore it into the live objects given.

    ``model``, ``optimizer``, ``accountant`` and ``sampler`` are restored in place. The
    clipping state is returned as ``Checkpoint.clip_state``: Opake's clip states
    (``opake.dpsgd.clipping``) are rebuilt from the file alone (``clip_state=``, if given, only
    checks the type); other state objects are rebuilt from the ``clip_state=`` template.
    With ``rng=True`` the global torch / numpy / Python RNG states are restored too.

    With ``strict=True`` (the default) every component stored in the file must be given: a run
    resumed without its accountant would restart ε from zero and under-report the privacy spent.
    A component given but absent from the file is always an error. The model is validated
    (names, shapes, dtypes) before anything is modified.

    Raises:
        CheckpointError: unreadable, damaged or foreign file; a mismatch with the live objects.
    """
    return prepare_load(
        path,
        model=model,
        optimizer=optimizer,
        accountant=accountant,
        sampler=sampler,
        clip_state=clip_state,
        rng=rng,
        strict=strict,
        map_location=map_location,
    )()


#: the parts restored first (the optimizer) and last but the model (the accountant)
_EDGES = ("optimizer", "accountant")


def prepare_load(
    path: str | os.PathLike[str],
    *,
    model: Any = None,
    optimizer: Any = None,
    accountant: Any = None,
    sampler: Any = None,
    clip_state: Any = None,
    rng: bool = True,
    strict: bool = True,
    map_location: Any = "cpu",
) -> Callable[[], Checkpoint]:
    """:func:`load_checkpoint` in two halves: read and validate everything now (raising what
    it would), restore when the returned function is called — for a caller with more to
    restore in between (the sharded loader restores the shards once the DP state is known to
    fit)."""
    target = Path(path)
    payload = _read(target, map_location)
    components: dict[str, Any] = payload["components"]
    given = {
        "model": model,
        "optimizer": optimizer,
        "accountant": accountant,
        "sampler": sampler,
        "clip_state": clip_state,
    }
    _check_given(target, components, given, strict)
    appliers: list[Callable[[], None]] = []
    restore_model = None if model is None else _restore_model(model, components["model"])
    loaders: dict[str, Callable[[], None]] = {}
    for name in _STATEFUL:
        obj = given[name]
        if obj is None:
            continue
        saved = components[name]
        if not isinstance(saved, Mapping) or "state" not in saved:
            raise CheckpointError(f"checkpoint component {name!r} is malformed")
        if not callable(getattr(obj, "load_state_dict", None)):
            raise InputTypeError(
                f"{name}={type(obj).__name__}: expected an object with load_state_dict()"
            )
        if saved.get("kind") != type(obj).__name__:
            raise CheckpointError(
                f"checkpoint {name} was saved from a {saved.get('kind')} but is being restored "
                f"into a {type(obj).__name__}; use the same kind of object"
            )
        loaders[name] = _loader(obj, saved["state"], name)
    # every part was checked above (an object's check_state_dict, the RNG on throwaway
    # generators); the optimizer goes first (the wrapped torch optimizer's restore casts every
    # state tensor and may still fail: it then changes nothing), the accountant after the
    # other parts and the model last: a failure part-way never leaves the file's weights
    # restored under an accountant that was not
    if "optimizer" in loaders:  # first: torch's own restore may still fail, changing nothing
        appliers.append(loaders["optimizer"])
    appliers += [loader for name, loader in loaders.items() if name not in _EDGES]
    if rng and "rng" in components:
        appliers.append(_restore_rng(components["rng"]))
    if "accountant" in loaders:
        appliers.append(loaders["accountant"])
    if restore_model is not None:  # last: a part that fails to restore leaves the weights be
        appliers.append(restore_model)
    restored_clip = None
    if "clip_state" in components and (
        clip_state is not None or _self_describing(components["clip_state"])
    ):
        restored_clip = _decode_value(clip_state, components["clip_state"])

    def finish() -> Checkpoint:
        for apply in appliers:
            apply()
        return Checkpoint(
            path=target,
            step=payload["step"],
            clip_state=restored_clip,
            extra=payload["extra"],
            components=tuple(components),
        )

    return finish


def _check_given(
    target: Path, components: dict[str, Any], given: dict[str, Any], strict: bool
) -> None:
    """Every component given is in the file; with ``strict``, every saved one is given."""
    absent = [name for name, obj in given.items() if obj is not None and name not in components]
    if absent:
        raise CheckpointError(
            f"{str(target)!r} holds no {', '.join(absent)} (it has "
            f"{', '.join(components) or 'nothing'}); save them with save_checkpoint or do not "
            "pass them"
        )
    if strict:
        unrestored = [
            name
            for name in components
            if name in given
            and given[name] is None
            and not (name == "clip_state" and _self_describing(components[name]))
        ]
        if unrestored:
            raise CheckpointError(
                f"{str(target)!r} holds {', '.join(unrestored)} but load_checkpoint was not given "
                f"{'it' if len(unrestored) == 1 else 'them'}; pass every saved component (a "
                "run resumed without its accountant would under-report ε), or strict=False"
            )
