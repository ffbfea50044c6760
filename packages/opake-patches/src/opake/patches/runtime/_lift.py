"""Turn a checkpointed call into "flat tensors + a way to re-run it with other tensors".

A custom ``autograd.Function`` only works under ``torch.func`` transforms when every tensor it
depends on is an explicit input: a tensor captured by a closure (a layer's weights swapped in by
``functional_call``, an attention mask held by a ``functools.partial``) trips an internal
functorch assert. :func:`lift_call` walks the callable and its arguments and pulls out

* every tensor in the positional and keyword arguments (nested lists, tuples and dicts too),
* every tensor in a ``functools.partial``'s arguments and keywords, in a bound method's
  ``__self__`` and in a Python function's closure cells and defaults,
* the parameters and buffers of every ``nn.Module`` reachable that way (a module, a module's
  bound method, HF's ``partial(forward, layer, **kwargs)``, modules in closure cells, modules
  named as globals by the function's code).

:meth:`LiftedCall.call` rebuilds the callable with replacement tensors (closures are rebuilt with
fresh cells, never mutated) and runs it with the modules re-parametrised through
``torch.func.functional_call``. Tensors hidden elsewhere (attributes of arbitrary objects, a
tensor global) are not found; the checkpoint reports that case with an explanation.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["LiftedCall", "lift_call"]

_MAX_DEPTH = 32


@dataclass(frozen=True)
class _Slot:
    """Placeholder for the tensor at ``index`` of the free-tensor list."""

    index: int


@dataclass(frozen=True)
class _Partial:
    func: Any
    args: Any
    keywords: Any


@dataclass(frozen=True)
class _Method:
    func: Any
    self_: Any


@dataclass(frozen=True)
class _Function:
    fn: types.FunctionType
    cells: tuple[Any, ...]
    defaults: Any
    kwdefaults: Any


@dataclass(frozen=True)
class _Seq:
    kind: type
    items: tuple[Any, ...]


@dataclass(frozen=True)
class _Map:
    kind: type
    items: tuple[tuple[Any, Any], ...]


_EMPTY_CELL = object()


def _is_sequence(obj: object) -> TypeGuard[list[Any] | tuple[Any, ...]]:
    """A plain list or tuple, or a named tuple: the sequences the walk looks into."""
    return type(obj) in (list, tuple) or (isinstance(obj, tuple) and hasattr(obj, "_fields"))


@dataclass
class _Walker:
    tensors: list[torch.Tensor] = field(default_factory=list)
    tensor_ids: dict[int, int] = field(default_factory=dict)
    modules: list[nn.Module] = field(default_factory=list)
    module_ids: set[int] = field(default_factory=set)
    seen_functions: set[int] = field(default_factory=set)

    def add_tensor(self, t: torch.Tensor) -> _Slot:
        key = id(t)
        if key not in self.tensor_ids:
            self.tensor_ids[key] = len(self.tensors)
            self.tensors.append(t)
        return _Slot(self.tensor_ids[key])

    def add_module(self, m: nn.Module) -> None:
        if id(m) not in self.module_ids:
            self.module_ids.add(id(m))
            self.modules.append(m)

    def walk(self, obj: object, depth: int = 0) -> object:
        """``obj`` itself where it holds no tensor to lift, else its template (``_Slot`` ...)."""
        import torch
        from torch import nn

        if depth > _MAX_DEPTH:
            return obj
        if isinstance(obj, torch.Tensor):
            return self.add_tensor(obj)
        if isinstance(obj, nn.Module):
            self.add_module(obj)
            return obj
        if isinstance(obj, functools.partial):
            func = self.walk(obj.func, depth + 1)
            args = self.walk(obj.args, depth + 1)
            keywords = self.walk(obj.keywords, depth + 1)
            if func is obj.func and args is obj.args and keywords is obj.keywords:
                return obj
            return _Partial(func, args, keywords)
        if isinstance(obj, types.MethodType):
            self_ = obj.__self__
            if not isinstance(self_, nn.Module):
                self._collect_attrs(self_)
            func = self.walk(obj.__func__, depth + 1)
            new_self = self.walk(self_, depth + 1)
            if func is obj.__func__ and new_self is self_:
                return obj
            return _Method(func, new_self)
        if isinstance(obj, types.FunctionType):
            return self._walk_function(obj, depth)
        if _is_sequence(obj):
            items = tuple(self.walk(v, depth + 1) for v in obj)
            if all(a is b for a, b in zip(items, obj, strict=True)):
                return obj  # nothing inside was lifted: keep the very same object
            return _Seq(type(obj), items)
        if type(obj) is dict:
            values = [(k, self.walk(v, depth + 1)) for k, v in obj.items()]
            if all(v is obj[k] for k, v in values):
                return obj
            return _Map(dict, tuple(values))
        return obj

    def _collect_attrs(self, obj: object) -> None:
        """Modules held as attributes of a plain object (``helper.model``) are re-parametrised."""
        from torch import nn

        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            for value in attrs.values():
                if isinstance(value, nn.Module):
                    self.add_module(value)

    def _walk_function(self, fn: types.FunctionType, depth: int) -> types.FunctionType | _Function:
        from torch import nn

        if id(fn) in self.seen_functions:  # recursive closures
            return fn
        self.seen_functions.add(id(fn))
        for name in fn.__code__.co_names:  # modules named as globals: re-parametrised in place
            value = fn.__globals__.get(name)
            if isinstance(value, nn.Module):
                self.add_module(value)
        cells: list[Any] = []
        for cell in fn.__closure__ or ():
            try:
                content = cell.cell_contents
            except ValueError:
                cells.append(_EMPTY_CELL)
                continue
            cells.append(self.walk(content, depth + 1))
        defaults = self.walk(fn.__defaults__, depth + 1) if fn.__defaults__ else None
        kwdefaults = self.walk(fn.__kwdefaults__, depth + 1) if fn.__kwdefaults__ else None
        originals = [
            _EMPTY_CELL if _cell_empty(c) else c.cell_contents for c in fn.__closure__ or ()
        ]
        unchanged = (
            all(a is b for a, b in zip(cells, originals, strict=True))
            and (defaults is None or defaults is fn.__defaults__)
            and (kwdefaults is None or kwdefaults is fn.__kwdefaults__)
        )
        if unchanged:
            return fn
        return _Function(fn, tuple(cells), defaults, kwdefaults)


def _cell_empty(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - probing for an empty cell
    except ValueError:
        return True
    return False


def _rebuild(tpl: Any, free: Sequence[torch.Tensor]) -> Any:  # Any: the caller's own objects
    if isinstance(tpl, _Slot):
        return free[tpl.index]
    if isinstance(tpl, _Partial):
        return functools.partial(
            _rebuild(tpl.func, free), *_rebuild(tpl.args, free), **_rebuild(tpl.keywords, free)
        )
    if isinstance(tpl, _Method):
        return types.MethodType(_rebuild(tpl.func, free), _rebuild(tpl.self_, free))
    if isinstance(tpl, _Function):
        cells = tuple(
            types.CellType() if c is _EMPTY_CELL else types.CellType(_rebuild(c, free))
            for c in tpl.cells
        )
        fn = tpl.fn
        new = types.FunctionType(
            fn.__code__,
            fn.__globals__,
            fn.__name__,
            _rebuild(tpl.defaults, free) if tpl.defaults is not None else fn.__defaults__,
            cells or None,
        )
        new.__kwdefaults__ = (
            _rebuild(tpl.kwdefaults, free) if tpl.kwdefaults is not None else fn.__kwdefaults__
        )
        new.__dict__.update(fn.__dict__)
        new.__qualname__ = fn.__qualname__
        return new
    if isinstance(tpl, _Seq):
        items = [_rebuild(v, free) for v in tpl.items]
        if tpl.kind in (list, tuple):
            return tpl.kind(items)
        return tpl.kind(*items)  # namedtuple
    if isinstance(tpl, _Map):
        return {k: _rebuild(v, free) for k, v in tpl.items}
    return tpl


class _Holder:
    """Lazily built ``nn.Module`` whose children are the reachable modules (for functional_call)."""

    @staticmethod
    def build(modules: Sequence[nn.Module]) -> nn.Module:
        from torch import nn

        class _CheckpointHolder(nn.Module):
            def __init__(self, mods: Sequence[nn.Module]) -> None:
                super().__init__()
                self.roots = nn.ModuleList(mods)

            def forward(self, thunk: Callable[[], object]) -> object:
                return thunk()

        return _CheckpointHolder(modules)


@dataclass
class LiftedCall:
    """A call whose tensors are explicit: ``tensors`` plus everything needed to re-run it.

    ``tensors`` lists the module state first (``n_state`` entries, named ``state_names`` inside
    ``holder``), then the free tensors found in the callable and the arguments.
    """

    template: object
    tensors: list[torch.Tensor]
    n_state: int
    state_names: list[str]
    holder: nn.Module | None

    def call(self, tensors: Sequence[torch.Tensor]) -> object:
        """Run the original computation with *tensors* in place of :attr:`tensors`."""
        free = tensors[self.n_state :]
        fn, args, kwargs = _rebuild(self.template, free)
        if self.holder is None:
            return fn(*args, **kwargs)
        import torch

        state = dict(zip(self.state_names, tensors[: self.n_state], strict=True))
        return torch.func.functional_call(self.holder, state, (lambda: fn(*args, **kwargs),))


def lift_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> LiftedCall:
    """Lift *fn(*args, **kwargs)* into explicit tensors (see the module docstring).

    >>> import torch
    >>> lin = torch.nn.Linear(2, 2)
    >>> lifted = lift_call(lin, (torch.ones(1, 2),), {})
    >>> lifted.n_state, len(lifted.tensors)
    (2, 3)
    >>> zeros = [torch.zeros_like(t) for t in lifted.tensors]
    >>> lifted.call(zeros).tolist()
    [[0.0, 0.0]]
    """
    walker = _Walker()
    template = walker.walk((fn, args, kwargs))
    if not walker.modules:
        return LiftedCall(template, list(walker.tensors), 0, [], None)
    holder = _Holder.build(walker.modules)
    names: list[str] = []
    state: list[torch.Tensor] = []
    seen: set[int] = set()
    for name, t in [*holder.named_parameters(), *holder.named_buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        names.append(name)
        state.append(t)
    free = list(walker.tensors)
    # a module tensor also captured directly (``partial(f, layer.weight)``) stays a free input
    return LiftedCall(template, state + free, len(state), names, holder)
