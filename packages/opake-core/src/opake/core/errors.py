"""Typed errors raised by every Opake distribution.

Every error says what was given, what was expected, and what to do about it.

Example:
    >>> from opake.core.errors import ConfigurationError, OpakeError
    >>> try:
    ...     raise ConfigurationError("clipping_norm=-1.0: expected a positive float")
    ... except ValueError as err:  # also catchable as the builtin it refines
    ...     isinstance(err, OpakeError)
    True
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "ConfigurationError",
    "InputTypeError",
    "OpakeError",
    "OpakePluginWarning",
    "OpakePrivacyWarning",
    "OperationError",
    "suggest",
    "unknown_keyword",
]


class OpakeError(Exception):
    """Base class of every error Opake raises on purpose."""


class ConfigurationError(OpakeError, ValueError):
    """A value, option or combination of options is invalid (also a ``ValueError``)."""


class InputTypeError(OpakeError, TypeError):
    """An argument has the wrong type (also a ``TypeError``)."""


class OperationError(OpakeError, RuntimeError):
    """An operation cannot run in the current state or context (also a ``RuntimeError``)."""


class OpakePluginWarning(UserWarning):
    """A plugin could not be loaded or was skipped; ``opake info`` lists it."""


class OpakePrivacyWarning(UserWarning):
    """Something weakens or does not match the stated privacy guarantee."""


def suggest(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``known`` to ``name``, or ``""``.

    >>> suggest("clipping_nrom", ["clipping_norm", "microbatch_size"])
    " (did you mean 'clipping_norm'?)"
    """
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_keyword(where: str, unknown: Mapping[str, Any], accepted: Iterable[str]) -> None:
    """Raise :class:`ConfigurationError` naming the first of ``unknown`` (keyword arguments a
    function received but does not take: ``**unknown``), the closest ``accepted`` one and the
    whole list; nothing when ``unknown`` is empty.

    >>> try:
    ...     unknown_keyword("f()", {"nrom": 1.0}, ["norm", "seed"])
    ... except ConfigurationError as err:
    ...     print(err)
    f() got an unknown keyword argument 'nrom' (did you mean 'norm'?); accepted: norm, seed
    """
    if not unknown:
        return
    options = list(accepted)
    name = next(iter(unknown))
    raise ConfigurationError(
        f"{where} got an unknown keyword argument {name!r}{suggest(name, options)}; accepted: "
        f"{', '.join(options)}"
    )
