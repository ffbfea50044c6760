"""Resolve ``"package.module:attr"`` / ``"package.module.attr"`` references lazily."""

from __future__ import annotations

import importlib
import re

from opake.core.errors import ConfigurationError

__all__ = ["is_dotted_path", "resolve_dotted"]

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = re.compile(rf"^{_IDENT}(\.{_IDENT})*(:{_IDENT}(\.{_IDENT})*)?$")


def is_dotted_path(value: object) -> bool:
    """Return True if *value* is a string shaped like ``pkg.mod:attr`` or ``pkg.mod.attr``.

    >>> is_dotted_path("opake.core.errors:OpakeError"), is_dotted_path("not a path")
    (True, False)
    """
    return isinstance(value, str) and bool(_DOTTED.match(value)) and (":" in value or "." in value)


def resolve_dotted(path: str) -> object:
    """Import and return the object *path* names (callers check what they got: it is user input).

    >>> resolve_dotted("opake.core.errors:OpakeError").__name__
    'OpakeError'
    """
    if not is_dotted_path(path):
        raise ConfigurationError(
            f"{path!r} is not a dotted path; expected 'package.module:attribute' "
            "or 'package.module.attribute'."
        )
    if ":" in path:
        module_name, attr_path = path.split(":", 1)
    else:
        module_name, _, attr_path = path.rpartition(".")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigurationError(
            f"cannot import module {module_name!r} named by {path!r}: {err}. "
            "Is the distribution that provides it installed?"
        ) from err
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as err:
            raise ConfigurationError(
                f"{path!r}: module {module_name!r} has no attribute path {attr_path!r}."
            ) from err
    return obj
