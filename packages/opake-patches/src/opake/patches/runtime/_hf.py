"""Keep Hugging Face's "inputs require grad" hook from breaking ``torch.func`` transforms.

``gradient_checkpointing_enable()`` (and PEFT) call ``enable_input_require_grads()``, which
registers a forward hook on the input embeddings doing ``output.requires_grad_(True)``. Inside
``grad``/``vmap(grad(...))`` that call raises ("requires_grad_() inside of a function being
transformed"); there it is also pointless, since a transform tracks differentiability by level.
:func:`make_hooks_transform_safe` replaces such hooks by wrappers that do nothing inside a
transform and call the original hook outside. :func:`patch_transformers` wraps
``PreTrainedModel.enable_input_require_grads`` so hooks registered from now on are safe; it is
installed as soon as ``transformers.modeling_utils`` is imported (now or later).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = [
    "install_transformers_patch",
    "make_hooks_transform_safe",
    "restore_hooks",
    "uninstall_transformers_patch",
]

_TARGET = "transformers.modeling_utils"
_lock = threading.RLock()


def _transform_safe(hook: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(hook)
    def hook_outside_transforms(module: Any, args: Any, output: Any) -> Any:
        import torch

        if torch._C._functorch.maybe_current_level() is not None:
            return None
        return hook(module, args, output)

    hook_outside_transforms._opake_stock_hook = hook  # type: ignore[attr-defined]
    return hook_outside_transforms


def _handles(model: Any) -> list[Any]:
    handles = list(getattr(model, "_require_grads_hooks", None) or [])
    single = getattr(model, "_require_grads_hook", None)
    if single is not None and all(single is not h for h in handles):
        handles.append(single)
    return handles


def make_hooks_transform_safe(model: Any) -> list[tuple[dict[int, Any], int, Any]]:
    """Wrap the model's registered "inputs require grad" hooks; return what to restore.

    Returns ``(hooks_dict, hook_id, stock_hook)`` triples for :func:`restore_hooks`.
    """
    changed = []
    for handle in _handles(model):
        ref = getattr(handle, "hooks_dict_ref", None)
        hooks = ref() if callable(ref) else None
        if not isinstance(hooks, dict) or handle.id not in hooks:
            continue
        hook = hooks[handle.id]
        if hasattr(hook, "_opake_stock_hook"):
            continue
        hooks[handle.id] = _transform_safe(hook)
        changed.append((hooks, handle.id, hook))
    return changed


def restore_hooks(changed: list[tuple[dict[int, Any], int, Any]]) -> None:
    """Undo :func:`make_hooks_transform_safe` (hooks removed meanwhile are left alone)."""
    for hooks, hook_id, stock in changed:
        if hook_id in hooks:
            hooks[hook_id] = stock


class _State:
    stock: Callable[..., Any] | None = None
    cls: type | None = None
    finder: _PatchOnImport | None = None


def patch_transformers(module: ModuleType) -> None:
    """Wrap ``PreTrainedModel.enable_input_require_grads`` in *module* (idempotent)."""
    with _lock:
        cls = getattr(module, "PreTrainedModel", None)
        stock = getattr(cls, "enable_input_require_grads", None)
        if cls is None or stock is None or getattr(stock, "_opake_patch", None):
            return

        @functools.wraps(stock)
        def enable_input_require_grads(self: Any) -> None:
            stock(self)
            make_hooks_transform_safe(self)

        enable_input_require_grads._opake_patch = "vmap_checkpointing"  # type: ignore[attr-defined]
        _State.stock = stock
        _State.cls = cls
        cls.enable_input_require_grads = enable_input_require_grads


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self.inner.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        patch_transformers(module)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches ``transformers.modeling_utils`` right after it is first imported."""

    def find_spec(
        self, fullname: str, path: Any, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install_transformers_patch() -> None:
    """Patch transformers now if it is imported, otherwise as soon as it is."""
    with _lock:
        module = sys.modules.get(_TARGET)
        if module is not None:
            patch_transformers(module)
        elif _State.finder is None:
            _State.finder = _PatchOnImport()
            sys.meta_path.insert(0, _State.finder)


def uninstall_transformers_patch() -> None:
    """Restore the stock ``enable_input_require_grads`` and drop the import hook."""
    with _lock:
        if _State.finder is not None:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(_State.finder)
            _State.finder = None
        if _State.cls is not None and _State.stock is not None:
            _State.cls.enable_input_require_grads = _State.stock  # type: ignore[attr-defined]
        _State.cls = None
        _State.stock = None
