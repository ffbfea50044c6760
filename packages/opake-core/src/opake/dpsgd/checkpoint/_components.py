"""The components of a checkpoint: model tensors, stateful objects, the clip state, RNG states.

Each ``_restore_*`` / ``_loader`` validates a saved component and returns the function that
applies it, so that :func:`~opake.dpsgd.checkpoint.load_checkpoint` changes nothing until every
component was checked.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError

if TYPE_CHECKING:
    import numpy as np
    import torch
    from numpy.typing import NDArray

from opake.dpsgd.checkpoint._file import CheckpointError


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


def _decode_value(template: Any, saved: Any) -> object:
    """The clip state ``saved`` describes: an Opake clip state, or an object like ``template``."""
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


def numpy_legacy_state() -> tuple[str, NDArray[np.uint32], int, int, float]:
    """numpy's global ``RandomState`` as ``(name, keys, pos, has_gauss, cached_gaussian)``."""
    import numpy as np

    state = np.random.get_state(legacy=True)
    if isinstance(state, dict):  # pragma: no cover - only for a non-MT19937 bit generator
        raise CheckpointError(
            f"numpy's global RandomState uses {state.get('bit_generator')!r}, not MT19937: "
            "its state cannot be recorded"
        )
    return state


def cuda_rng_states() -> list[torch.Tensor] | None:
    """Every CUDA device's RNG state; ``None`` while CUDA is not initialised (nothing to keep)."""
    import torch

    # torch leaves torch.cuda.is_initialized unannotated: its signature, stated
    is_initialized: Callable[[], bool] = torch.cuda.is_initialized
    return torch.cuda.get_rng_state_all() if is_initialized() else None


def _rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    np_state = numpy_legacy_state()
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
        "cuda": cuda_rng_states(),
    }
    return state


def _restore_rng(saved: Any) -> Callable[[], None]:
    import numpy as np
    import torch

    if not isinstance(saved, Mapping) or not {"torch", "python", "numpy", "cuda"} <= set(saved):
        raise CheckpointError("checkpoint component 'rng' is malformed")

    def to_tuple(value: Any) -> Any:  # Any: random.setstate's nested tuple, untyped
        return tuple(to_tuple(v) for v in value) if isinstance(value, list | tuple) else value

    def numpy_state() -> tuple[Any, ...]:
        np_saved = saved["numpy"]
        return (
            np_saved["name"],
            np_saved["keys"].numpy().astype(np.uint32),
            np_saved["pos"],
            np_saved["has_gauss"],
            np_saved["cached_gaussian"],
        )

    cuda = saved["cuda"]
    try:  # each state set on a throwaway generator first: a refusal restores nothing
        torch.Generator().set_state(saved["torch"])
        random.Random().setstate(to_tuple(saved["python"]))
        np.random.RandomState().set_state(numpy_state())
        _check_cuda_states(cuda)
    except (LookupError, TypeError, ValueError, RuntimeError, AttributeError) as err:
        raise CheckpointError(f"checkpoint component 'rng' is malformed: {err}") from err

    def apply() -> None:
        torch.set_rng_state(saved["torch"])
        random.setstate(to_tuple(saved["python"]))
        np.random.set_state(numpy_state())
        if cuda is not None and torch.cuda.is_available():
            # one state per device this process has (saved on more devices: the rest have none)
            for index, state in enumerate(cuda[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(state, index)

    return apply


def _check_cuda_states(cuda: Any) -> None:
    """Saved CUDA generator states: ``None``, or 1-D uint8 tensors, each of the size this
    process's device generator takes (checked where CUDA is available)."""
    import torch

    if cuda is None:
        return
    if not isinstance(cuda, list | tuple) or not all(
        isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 for t in cuda
    ):
        raise TypeError(f"CUDA states {type(cuda).__name__}: expected a list of uint8 tensors")
    if torch.cuda.is_available():
        for index, state in enumerate(cuda[: torch.cuda.device_count()]):
            size = torch.cuda.get_rng_state(index).numel()
            if state.numel() != size:
                raise ValueError(
                    f"CUDA state {index} has {state.numel()} bytes; device {index}'s generator "
                    f"takes {size}"
                )


def _self_describing(saved: Any) -> bool:
    """An opake clip state is rebuilt from the file alone; other kinds need a template."""
    return isinstance(saved, Mapping) and saved.get("kind") == "clip_state"


def _loader(obj: Any, state: Any, name: str) -> Callable[[], None]:
    """What restores ``obj`` from ``state``; an object with ``check_state_dict`` (Opake's DP
    optimizers and accountants) is checked here, before any component is restored, so a
    refused state (e.g. one that would rewind a secure noise source) changes nothing."""

    def guarded(call: Callable[[Any], None]) -> None:
        try:
            call(state)
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            if isinstance(err, ConfigurationError | InputTypeError):
                raise CheckpointError(f"checkpoint {name} does not fit: {err}") from err
            raise CheckpointError(
                f"checkpoint {name} does not fit {type(obj).__name__}: {err}"
            ) from err

    check = getattr(obj, "check_state_dict", None)
    if callable(check):
        guarded(check)

    def apply() -> None:
        guarded(obj.load_state_dict)

    return apply
