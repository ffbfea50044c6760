"""Record every change made to a model instance so that it can be undone exactly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Patcher", "tag"]

_MISSING = object()


def tag(fn: Callable[..., Any], name: str, value: object) -> None:
    """Leave the mark ``fn.<name> = value`` on a function Opake installs (``_opake_stage``,
    ``_opake_patch``, ``__wrapped__`` ...), read back with ``getattr``: a function takes any
    attribute, though its type declares none.

    >>> def f(): pass
    >>> tag(f, "_opake_stage", "demo"); f._opake_stage
    'demo'
    """
    setattr(fn, name, value)


class Patcher:
    """A stack of undo actions: changes are applied now and reverted, newest first, by ``undo``.

    Only instance state is touched (instance ``__dict__`` entries, config attributes, hook
    dictionaries), never a class, so other instances of the same model class are unaffected.

    Example:
        >>> class Obj:
        ...     def f(self):
        ...         return "class"
        >>> o = Obj()
        >>> p = Patcher()
        >>> p.set_attr(o, "f", lambda: "instance")
        >>> o.f(), len(p)
        ('instance', 1)
        >>> p.undo(); o.f(), "f" in vars(o)
        ('class', False)
    """

    def __init__(self) -> None:
        self._actions: list[Callable[[], None]] = []

    def __len__(self) -> int:
        return len(self._actions)

    def push(self, action: Callable[[], None]) -> None:
        """Remember how to undo a change made by the caller."""
        if not callable(action):
            raise TypeError(f"undo action must be callable, got {action!r}")
        self._actions.append(action)

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """Set ``obj.name = value`` on the instance; undo restores (or deletes) the old entry."""
        namespace = vars(obj)
        old = namespace.get(name, _MISSING)
        setattr(obj, name, value)

        def restore() -> None:
            if old is _MISSING:
                vars(obj).pop(name, None)
            else:
                vars(obj)[name] = old

        self._actions.append(restore)

    def set_config(self, config: Any, name: str, value: Any) -> None:
        """Set a (possibly attribute-mapped) config field; undo sets the old value back."""
        old = getattr(config, name)
        setattr(config, name, value)
        self._actions.append(lambda: setattr(config, name, old))

    def undo(self) -> None:
        """Run every undo action, newest first (idempotent)."""
        while self._actions:
            self._actions.pop()()
