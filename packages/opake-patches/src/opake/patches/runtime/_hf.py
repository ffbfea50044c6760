"""Keep Hugging Face's "inputs require grad" hook and input checks from breaking ``torch.func``
transforms.

``gradient_checkpointing_enable()`` (and PEFT) call ``enable_input_require_grads()``, which
registers a forward hook on the input embeddings doing ``output.requires_grad_(True)``. Inside
``grad``/``vmap(grad(...))`` that call raises ("requires_grad_() inside of a function being
transformed"); there it is also pointless, since a transform tracks differentiability by level.
:func:`make_hooks_transform_safe` replaces such hooks by wrappers that do nothing inside a
transform and call the original hook outside. :func:`patch_transformers` wraps
``PreTrainedModel.enable_input_require_grads`` so hooks registered from now on are safe; it is
installed as soon as ``transformers.modeling_utils`` is imported (now or later).

The same patch wraps ``PreTrainedModel.warn_if_padding_and_no_attention_mask``: it asks whether
``pad_token_id`` is among the first or last input ids when no attention mask is given (GPT-2 and
other families call it at the top of ``forward``), a question about the *values* of the inputs
that ``vmap`` cannot answer (``RuntimeError: vmap: ... .item()``). The check only warns, so
inside a transform it is skipped; outside, the stock check runs.
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
from typing import Any, ClassVar

from opake.functional import in_transform, outside_transforms
from opake.patches._patcher import tag

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
    def hook_outside_transforms(module: Any, args: Any, output: Any) -> object:
        if in_transform():
            return None
        return hook(module, args, output)

    tag(hook_outside_transforms, "_opake_stock_hook", hook)
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


def _safe_require_grads(stock: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(stock)
    def enable_input_require_grads(self: Any) -> None:
        stock(self)
        make_hooks_transform_safe(self)

    return enable_input_require_grads


#: the ``PreTrainedModel`` methods wrapped, and how
_WRAPPERS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "enable_input_require_grads": _safe_require_grads,
    "warn_if_padding_and_no_attention_mask": outside_transforms,
}


class _State:
    cls: type | None = None
    stock: ClassVar[dict[str, Callable[..., Any]]] = {}
    finder: _PatchOnImport | None = None


def patch_transformers(module: ModuleType) -> None:
    """Wrap the methods of ``PreTrainedModel`` in :data:`_WRAPPERS` in *module* (idempotent)."""
    with _lock:
        cls = getattr(module, "PreTrainedModel", None)
        if cls is None:
            return
        for name, wrap in _WRAPPERS.items():
            stock = getattr(cls, name, None)
            if stock is None or getattr(stock, "_opake_patch", None):
                continue
            patched = wrap(stock)
            tag(patched, "_opake_patch", "vmap_checkpointing")
            _State.stock = {**_State.stock, name: stock}
            _State.cls = cls
            setattr(cls, name, patched)


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
    """Restore the stock ``PreTrainedModel`` methods and drop the import hook."""
    with _lock:
        if _State.finder is not None:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(_State.finder)
            _State.finder = None
        if _State.cls is not None:
            for name, stock in _State.stock.items():
                setattr(_State.cls, name, stock)
        _State.cls = None
        _State.stock = {}
