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

__all__ = [
    "ConfigurationError",
    "InputTypeError",
    "OpakeError",
    "OpakePluginWarning",
    "OpakePrivacyWarning",
    "OperationError",
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
