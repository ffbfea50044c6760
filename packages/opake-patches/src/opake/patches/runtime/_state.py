"""Install and remove the global runtime patches (idempotent, reversible, queryable)."""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from opake.core.errors import ConfigurationError, InputTypeError, OperationError
from opake.patches._patcher import tag

__all__ = [
    "PATCH_NAMES",
    "TESTED_TORCH",
    "RuntimePatchState",
    "apply_runtime_patches",
    "is_runtime_patched",
    "remove_runtime_patches",
    "runtime_patch_state",
]

#: the torch versions the runtime patches were written and tested against
TESTED_TORCH = "torch>=2.11,<2.14"
#: the independent runtime patches, by the keyword that turns each on
PATCH_NAMES = ("vmap_checkpointing", "save_on_cpu")

_T = TypeVar("_T")

# torch internals the patches rely on (checked before anything is replaced)
_REQUIRED = (
    ("torch._C._functorch", "maybe_current_level"),
    ("torch._functorch.pyfunctorch", "retrieve_all_functorch_interpreters"),
    ("torch._C._autograd", "_top_saved_tensors_default_hooks"),
    ("torch._C._autograd", "_saved_tensors_hooks_is_enabled"),
    ("torch.utils.checkpoint", "get_device_states"),
    ("torch.utils.checkpoint", "noop_context_fn"),
)


@dataclass(frozen=True)
class RuntimePatchState:
    """Which runtime patches are installed.

    Attributes:
        vmap_checkpointing: ``torch.utils.checkpoint.checkpoint`` routes calls made inside
            ``torch.func`` transforms to Opake's vmap-safe checkpoint.
        save_on_cpu: ``torch.autograd.graph.save_on_cpu`` is Opake's transform-aware subclass.
        torch_version: the torch the patches were installed on.
        rebound: how many module attributes (``from torch.utils.checkpoint import checkpoint``
            copies in already-imported modules) were re-pointed, beyond torch's own.
    """

    vmap_checkpointing: bool
    save_on_cpu: bool
    torch_version: str
    rebound: int = 0


@dataclass
class _Patch:
    """One replaced object: the stock one, the replacement and every place it was bound."""

    module: str
    name: str
    stock: Any
    patched: Any


class _Registry:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.active: dict[str, list[_Patch]] = {}
        self.undo: dict[str, Callable[[], None]] = {}
        self.rebound = 0


_registry = _Registry()


def _rebind(old: Any, new: Any) -> int:
    """Point every module-level attribute that *is* ``old`` at ``new``; return how many."""
    count = 0
    for mod in list(sys.modules.values()):
        try:
            namespace = vars(mod)
        except TypeError:
            continue
        try:
            names = [k for k, v in list(namespace.items()) if v is old]
        except Exception:  # exotic module proxies: skip them
            continue
        for name in names:
            try:
                setattr(mod, name, new)
            except Exception:  # read-only module objects: skip them
                continue
            count += 1
    return count


def _check_torch() -> str:
    try:
        import torch
    except ImportError as err:  # pragma: no cover - torch is a hard dependency
        raise OperationError("opake-patches needs torch; install torch>=2.9.") from err
    import importlib

    missing = []
    for module_name, attr in _REQUIRED:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(f"{module_name}.{attr}")
            continue
        if not hasattr(module, attr):
            missing.append(f"{module_name}.{attr}")
    if missing:
        raise OperationError(
            f"torch {torch.__version__} lacks internals the runtime patches need ({missing}); "
            f"they target {TESTED_TORCH}. Install a torch in that range or skip the patches."
        )
    return str(torch.__version__)


def _install_checkpoint() -> list[_Patch]:
    import torch.utils.checkpoint as tuc

    from opake.patches.runtime._checkpoint import vmap_checkpoint
    from opake.patches.runtime._transforms import transform_stack

    stock = tuc.checkpoint

    @functools.wraps(stock)
    def checkpoint(function: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        if transform_stack().needs_vmap_safe_checkpoint:
            return vmap_checkpoint(function, *args, **kwargs)
        out: _T = stock(function, *args, **kwargs)  # what function returns (unannotated there)
        return out

    tag(checkpoint, "_opake_patch", "vmap_checkpointing")
    return [_Patch("torch.utils.checkpoint", "checkpoint", stock, checkpoint)]


def _install_save_on_cpu_extras(patches: list[_Patch]) -> Callable[[], None]:
    from opake.patches.runtime._dynamo import register

    (disable,) = [p for p in patches if p.name == "disable_saved_tensors_hooks"]
    return register(disable.stock, disable.patched)


def _install_save_on_cpu() -> list[_Patch]:
    import torch.autograd.graph as autograd_graph

    from opake.patches.runtime._offload import make_patched_disable, make_patched_save_on_cpu

    stock_cls = autograd_graph.save_on_cpu
    stock_disable = autograd_graph.disable_saved_tensors_hooks
    return [
        _Patch(
            "torch.autograd.graph", "save_on_cpu", stock_cls, make_patched_save_on_cpu(stock_cls)
        ),
        _Patch(
            "torch.autograd.graph",
            "disable_saved_tensors_hooks",
            stock_disable,
            make_patched_disable(stock_disable),
        ),
    ]


_INSTALLERS: dict[str, Callable[[], list[_Patch]]] = {
    "vmap_checkpointing": _install_checkpoint,
    "save_on_cpu": _install_save_on_cpu,
}
# patches that are not a module attribute: install, return the undo
_EXTRAS: dict[str, Callable[[list[_Patch]], Callable[[], None]]] = {
    "save_on_cpu": _install_save_on_cpu_extras,
}


def _transformers_patch(active: bool) -> None:
    """Hugging Face's input hooks and checks made safe inside transforms (``runtime._hf``):
    installed while any runtime patch is, whichever — a model run under ``vmap`` needs it with
    or without checkpointing — and removed with the last one."""
    from opake.patches.runtime._hf import install_transformers_patch, uninstall_transformers_patch

    if active:
        install_transformers_patch()
    else:
        uninstall_transformers_patch()


def _enable(name: str) -> None:
    if name in _registry.active:
        return
    patches = _INSTALLERS[name]()
    for p in patches:
        module = sys.modules[p.module]
        if getattr(module, p.name) is not p.stock:  # pragma: no cover - defensive
            raise OperationError(
                f"{p.module}.{p.name} was already replaced by someone else "
                f"({getattr(module, p.name)!r}); remove that patch first."
            )
    for p in patches:
        _registry.rebound += _rebind(p.stock, p.patched) - 1
    _registry.active[name] = patches
    extra = _EXTRAS.get(name)
    if extra is not None:
        _registry.undo[name] = extra(patches)
    _transformers_patch(True)


def _disable(name: str) -> None:
    patches = _registry.active.pop(name, None)
    if patches is None:
        return
    undo = _registry.undo.pop(name, None)
    if undo is not None:
        undo()
    for p in reversed(patches):
        _registry.rebound -= _rebind(p.patched, p.stock) - 1
    _registry.rebound = max(_registry.rebound, 0)
    if not _registry.active:
        _transformers_patch(False)


def apply_runtime_patches(
    *, vmap_checkpointing: bool = True, save_on_cpu: bool = True, **unknown: Any
) -> RuntimePatchState:
    """Install Opake's global runtime patches; idempotent and reversible.

    Args:
        vmap_checkpointing: route ``torch.utils.checkpoint.checkpoint`` (and so
            ``checkpoint_sequential`` and Hugging Face gradient checkpointing) to Opake's
            vmap-safe checkpoint whenever it is called inside a ``torch.func`` transform; outside
            transforms the stock function runs unchanged. Default ``True``; ``False`` leaves
            ``checkpoint`` untouched (and removes Opake's patch if it was installed).
        save_on_cpu: make ``torch.autograd.graph.save_on_cpu`` usable around
            ``vmap(grad(...))`` / ``clipped_grad`` calls (checkpointed inputs go to the CPU).
            Default ``True``.

    The call is declarative: afterwards exactly the requested patches are installed. Calling it
    twice with the same options changes nothing. Unknown keywords raise
    :class:`~opake.core.errors.ConfigurationError`.

    Returns:
        The resulting :class:`RuntimePatchState`.

    Example:
        >>> import torch.utils.checkpoint as tuc
        >>> remove_runtime_patches()  # start from stock torch
        >>> stock = tuc.checkpoint
        >>> state = apply_runtime_patches()
        >>> state.vmap_checkpointing, tuc.checkpoint is stock, tuc.checkpoint.__wrapped__ is stock
        (True, False, True)
        >>> apply_runtime_patches() == state
        True
        >>> remove_runtime_patches(); tuc.checkpoint is stock
        True
    """
    if unknown:
        raise ConfigurationError(
            f"apply_runtime_patches() got unknown keyword argument(s) {sorted(unknown)}; "
            f"valid ones are {list(PATCH_NAMES)}."
        )
    wanted = {"vmap_checkpointing": vmap_checkpointing, "save_on_cpu": save_on_cpu}
    for name, value in wanted.items():
        if not isinstance(value, bool):
            raise InputTypeError(
                f"apply_runtime_patches({name}={value!r}): expected True or False."
            )
    with _registry.lock:
        version = _check_torch()
        for name in PATCH_NAMES:
            if not wanted[name]:
                _disable(name)
        try:
            for name in PATCH_NAMES:
                if wanted[name]:
                    _enable(name)
        except BaseException:
            for name in PATCH_NAMES:
                _disable(name)
            raise
        return RuntimePatchState(
            vmap_checkpointing="vmap_checkpointing" in _registry.active,
            save_on_cpu="save_on_cpu" in _registry.active,
            torch_version=version,
            rebound=_registry.rebound,
        )


def remove_runtime_patches() -> None:
    """Remove every runtime patch: the stock torch objects are bound again, by identity.

    Copies of the patched functions that modules imported while the patches were active are
    re-pointed at the stock objects too.

    >>> remove_runtime_patches(); is_runtime_patched()
    False
    """
    with _registry.lock:
        for name in reversed(PATCH_NAMES):
            _disable(name)
        _transformers_patch(False)  # also when installed on its own (``opake train`` does)


def is_runtime_patched(name: str | None = None) -> bool:
    """True if any runtime patch (or the one called *name*) is installed.

    >>> is_runtime_patched("vmap_checkpointing") in (True, False)
    True
    """
    if name is not None and name not in PATCH_NAMES:
        raise ConfigurationError(
            f"is_runtime_patched({name!r}): unknown patch; expected one of {list(PATCH_NAMES)}."
        )
    with _registry.lock:
        if name is None:
            return bool(_registry.active)
        return name in _registry.active


def runtime_patch_state() -> RuntimePatchState:
    """The current :class:`RuntimePatchState` (nothing is changed).

    >>> isinstance(runtime_patch_state().vmap_checkpointing, bool)
    True
    """
    import torch

    with _registry.lock:
        return RuntimePatchState(
            vmap_checkpointing="vmap_checkpointing" in _registry.active,
            save_on_cpu="save_on_cpu" in _registry.active,
            torch_version=str(torch.__version__),
            rebound=_registry.rebound,
        )
