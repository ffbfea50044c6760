"""Atomic checkpoint/resume of the whole DP training state.

Implementation of :mod:`opake.dpsgd.checkpoint` (the public façade).

File format: one ``torch.save`` archive holding a dict ``{"format": "opake.checkpoint",
"version": 1, "step", "components": {...}, "extra"}``. Only tensors and plain Python values
(dict, list, tuple, str, int, float, bool, None) are written, so loading uses
``torch.load(weights_only=True)`` and never runs code from the file.
"""

from __future__ import annotations

import dataclasses
import os
import random
import tempfile
import warnings
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError, OperationError

if TYPE_CHECKING:
    import torch

__all__ = ["Checkpoint", "CheckpointError", "atomic_write", "load_checkpoint", "save_checkpoint"]

FORMAT = "opake.checkpoint"
VERSION = 1
_STATEFUL = ("optimizer", "accountant", "sampler")
_COMPONENTS = ("model", *_STATEFUL, "clip_state", "rng")


class CheckpointError(OperationError):
    """A checkpoint cannot be read, or does not match what it is restored into."""


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


# -- atomic write ----------------------------------------------------------------------------


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None]) -> Path:
    """Write a file so that ``path`` holds either its old content or the complete new one.

    ``write`` fills a temporary file in the same directory; it is flushed and ``fsync``-ed, then
    renamed over ``path`` with ``os.replace`` (atomic on POSIX and Windows) and the directory is
    ``fsync``-ed. A crash at any point leaves the old file intact (and possibly a stale
    ``.<name>.*.tmp`` beside it); an exception removes the temporary file. New files are created
    readable by their owner only (``0600``); an existing file's mode is kept.

    Example:
        >>> import pathlib, tempfile
        >>> target = pathlib.Path(tempfile.mkdtemp()) / "data.bin"
        >>> atomic_write(target, lambda f: f.write(b"new")).read_bytes()
        b'new'
    """
    target = Path(path)
    directory = target.parent
    if not directory.is_dir():
        raise CheckpointError(
            f"cannot write {str(target)!r}: directory {str(directory)!r} does not exist; create "
            "it first"
        )
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        with suppress(FileNotFoundError):
            os.chmod(tmp_name, target.stat().st_mode & 0o7777)
        os.replace(tmp_name, target)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    _fsync_directory(directory)
    return target


def _fsync_directory(directory: Path) -> None:
    if os.name != "posix":  # Windows cannot open a directory; os.replace is durable enough there
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_payload(payload: dict[str, Any], handle: IO[bytes]) -> None:
    import torch

    torch.save(payload, handle)


# -- plain-data checks -----------------------------------------------------------------------


def _check_plain(value: Any, where: str) -> None:
    """Refuse anything ``torch.load(weights_only=True)`` could not read back."""
    import torch

    if value is None or isinstance(value, str | bool | int | float | torch.Tensor):
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str | int):
                raise InputTypeError(
                    f"{where} has a key {key!r} of type {type(key).__name__}; checkpoint dict keys "
                    "must be str or int"
                )
            _check_plain(item, f"{where}[{key!r}]")
        return
    raise InputTypeError(
        f"{where} is a {type(value).__name__}; a checkpoint holds only tensors and plain values "
        "(dict, list, tuple, str, int, float, bool, None) so that it loads without running code. "
        "Convert it (e.g. numpy arrays to tensors) in the object's state_dict()"
    )


# -- components ------------------------------------------------------------------------------


def _model_state(model: Any) -> dict[str, Any]:
    import torch

    if isinstance(model, torch.nn.Module):
        return {"kind": "module", "tensors": dict(model.state_dict())}
    if isinstance(model, Mapping):
        tensors = {}
        for name, value in model.items():
            if not isinstance(name, str) or not isinstance(value, torch.Tensor):
                raise InputTypeError(
                    f"model has an entry {name!r}: {type(value).__name__}; expected an nn.Module "
                    "or a name -> tensor dict"
                )
            tensors[name] = value.detach()
        return {"kind": "tensors", "tensors": tensors}
    raise InputTypeError(
        f"model={type(model).__name__}: expected an nn.Module or a name -> tensor dict (the "
        "params from make_functional)"
    )


def _restore_model(model: Any, saved: Any) -> Callable[[], None]:
    """Validate ``saved`` against ``model``; return the function that copies it in."""
    import torch

    if not isinstance(saved, Mapping) or not isinstance(saved.get("tensors"), Mapping):
        raise CheckpointError("checkpoint component 'model' is malformed (no tensor dict)")
    tensors: Mapping[str, Any] = saved["tensors"]
    if isinstance(model, torch.nn.Module):
        live: Mapping[str, torch.Tensor] = model.state_dict()
    elif isinstance(model, Mapping):
        live = model
    else:
        raise InputTypeError(
            f"model={type(model).__name__}: expected an nn.Module or a name -> tensor dict"
        )
    missing = sorted(set(live) - set(tensors))
    unexpected = sorted(set(tensors) - set(live))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint model does not match: missing {missing[:8]}, unexpected {unexpected[:8]}"
            f"{' (and more)' if len(missing) > 8 or len(unexpected) > 8 else ''}; restore into "
            "the same architecture (and the same make_functional partition) that was saved"
        )
    for name, value in tensors.items():
        target = live[name]
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"checkpoint model entry {name!r} is not a tensor")
        if value.shape != target.shape or value.dtype != target.dtype:
            raise CheckpointError(
                f"checkpoint model entry {name!r} is {value.dtype} {tuple(value.shape)} but the "
                f"live tensor is {target.dtype} {tuple(target.shape)}"
            )

    def apply() -> None:
        with torch.no_grad():
            for name, value in tensors.items():
                live[name].copy_(value)

    return apply


def _stateful(name: str, obj: Any) -> dict[str, Any]:
    state_dict = getattr(obj, "state_dict", None)
    if not callable(state_dict) or not callable(getattr(obj, "load_state_dict", None)):
        raise InputTypeError(
            f"{name}={type(obj).__name__}: expected an object with state_dict() and "
            "load_state_dict()"
        )
    return {"kind": type(obj).__name__, "state": state_dict()}


def _is_opake_clip_state(value: Any) -> bool:
    return (
        type(value).__module__.startswith("opake.dpsgd.")
        and callable(getattr(value, "to_dict", None))
        and isinstance(getattr(type(value), "kind", None), str)
    )


def _encode_value(value: Any) -> dict[str, Any]:
    """Encode a small state object (clip state): opake clip state, state_dict, dataclass, ..."""
    if _is_opake_clip_state(value):
        return {"kind": "clip_state", "type": type(value).__name__, "state": value.to_dict()}
    if callable(getattr(value, "state_dict", None)):
        return {"kind": "state_dict", "type": type(value).__name__, "state": value.state_dict()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return {"kind": "dataclass", "type": type(value).__name__, "state": fields}
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return {"kind": "namedtuple", "type": type(value).__name__, "state": dict(value._asdict())}
    return {"kind": "plain", "type": type(value).__name__, "state": value}


def _decode_value(template: Any, saved: Any) -> Any:
    if not isinstance(saved, Mapping) or not {"kind", "type", "state"} <= set(saved):
        raise CheckpointError("checkpoint component 'clip_state' is malformed")
    kind, type_name, state = saved["kind"], saved["type"], saved["state"]
    if kind == "clip_state":
        from opake.dpsgd.clipping import clip_state_from_dict

        if template is not None and type(template).__name__ != type_name:
            raise CheckpointError(
                f"checkpoint clip_state is a {type_name} but the template given is a "
                f"{type(template).__name__}; pass the state of the same clipping method"
            )
        try:
            return clip_state_from_dict(state)
        except (ValueError, TypeError) as err:
            raise CheckpointError(f"checkpoint clip_state is invalid: {err}") from err
    if template is None:
        raise CheckpointError(
            f"checkpoint clip_state is a {type_name}, which is rebuilt from a template: pass "
            "clip_state= (an instance of the same type) to load_checkpoint"
        )
    if kind != "plain" and type(template).__name__ != type_name:
        raise CheckpointError(
            f"checkpoint clip_state is a {type_name} but the template given is a "
            f"{type(template).__name__}; pass the state returned by the same clipped_grad setup"
        )
    if kind == "state_dict":
        loaded = template.load_state_dict(state)
        return template if loaded is None else loaded
    if kind in ("dataclass", "namedtuple"):
        names = (
            {f.name for f in dataclasses.fields(template)}
            if kind == "dataclass"
            else set(template._fields)
        )
        if set(state) != names:
            raise CheckpointError(
                f"checkpoint clip_state fields {sorted(state)} differ from the template's "
                f"{sorted(names)}"
            )
        if kind == "dataclass":
            return dataclasses.replace(template, **state)
        return template._replace(**state)
    if kind == "plain":
        return state
    raise CheckpointError(f"checkpoint clip_state has unknown kind {kind!r}")


def _rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    np_state: tuple[Any, ...] = np.random.get_state(legacy=True)  # type: ignore[assignment]
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "name": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
    }
    return state


def _restore_rng(saved: Any) -> Callable[[], None]:
    import numpy as np
    import torch

    if not isinstance(saved, Mapping) or not {"torch", "python", "numpy", "cuda"} <= set(saved):
        raise CheckpointError("checkpoint component 'rng' is malformed")

    def to_tuple(value: Any) -> Any:
        return tuple(to_tuple(v) for v in value) if isinstance(value, list | tuple) else value

    def apply() -> None:
        torch.set_rng_state(saved["torch"])
        random.setstate(to_tuple(saved["python"]))
        np_saved = saved["numpy"]
        np.random.set_state(
            (
                np_saved["name"],
                np_saved["keys"].numpy().astype(np.uint32),
                np_saved["pos"],
                np_saved["has_gauss"],
                np_saved["cached_gaussian"],
            )
        )
        if saved["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["cuda"])

    return apply


# -- public functions ------------------------------------------------------------------------


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


def _read(path: Path, map_location: Any) -> dict[str, Any]:
    import pickle
    import zipfile

    import torch

    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {str(path)!r} (file not found)")
    try:
        with warnings.catch_warnings():
            # a foreign pickle (other protocol) is refused below with a clear error anyway
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            payload = torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError,
            zipfile.BadZipFile) as err:  # fmt: skip
        raise CheckpointError(
            f"cannot read checkpoint {str(path)!r}: {err}. The file is damaged, truncated, or "
            "not an Opake checkpoint (an interrupted save never replaces the old file: look "
            "for the previous checkpoint)"
        ) from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(
            f"{str(path)!r} is not an Opake checkpoint (no '{FORMAT}' marker); write it with "
            "opake.dpsgd.checkpoint.save_checkpoint"
        )
    if payload.get("version") != VERSION:
        raise CheckpointError(
            f"{str(path)!r} is checkpoint format version {payload.get('version')!r}; this Opake "
            f"reads version {VERSION}"
        )
    step = payload.get("step")
    components = payload.get("components")
    extra = payload.get("extra")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{str(path)!r} has an invalid step {step!r}")
    if not isinstance(components, dict) or not set(components) <= set(_COMPONENTS):
        raise CheckpointError(f"{str(path)!r} has a malformed component table")
    if not isinstance(extra, dict):
        raise CheckpointError(f"{str(path)!r} has a malformed 'extra' entry")
    return payload


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
    appliers: list[Callable[[], None]] = []
    if model is not None:
        appliers.append(_restore_model(model, components["model"]))
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
        appliers.append(_loader(obj, saved["state"], name))
    if rng and "rng" in components:
        appliers.append(_restore_rng(components["rng"]))
    restored_clip = None
    if "clip_state" in components and (
        clip_state is not None or _self_describing(components["clip_state"])
    ):
        restored_clip = _decode_value(clip_state, components["clip_state"])
    for apply in appliers:
        apply()
    return Checkpoint(
        path=target,
        step=payload["step"],
        clip_state=restored_clip,
        extra=payload["extra"],
        components=tuple(components),
    )


def _self_describing(saved: Any) -> bool:
    """An opake clip state is rebuilt from the file alone; other kinds need a template."""
    return isinstance(saved, Mapping) and saved.get("kind") == "clip_state"


def _loader(obj: Any, state: Any, name: str) -> Callable[[], None]:
    def apply() -> None:
        try:
            obj.load_state_dict(state)
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, ConfigurationError | InputTypeError):
                raise CheckpointError(f"checkpoint {name} does not fit: {err}") from err
            raise CheckpointError(
                f"checkpoint {name} does not fit {type(obj).__name__}: {err}"
            ) from err

    return apply
