"""The typed errors ``opake.profiling`` raises.

``opake-profiling`` depends on torch only; ``opake-core`` is optional (the ``[core]`` extra, always
installed by the ``opake`` meta-distribution). When ``opake.core.errors`` is importable these are
*the same classes* as there, so ``except opake.core.errors.InputTypeError`` catches them. Without
``opake-core`` a local hierarchy with the same names and the same builtin bases is used, so
``except TypeError`` / ``except ValueError`` / ``except RuntimeError`` (or the names re-exported
from ``opake.profiling``) work in both installations.

Example:
    >>> from opake.profiling import InputTypeError
    >>> issubclass(InputTypeError, TypeError)
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "ConfigurationError",
    "InputTypeError",
    "NoMicrobatchFitsError",
    "OpakeError",
    "OperationError",
]

if TYPE_CHECKING:  # type checking runs with opake-core installed: its classes
    from opake.core.errors import (
        ConfigurationError,
        InputTypeError,
        OpakeError,
        OperationError,
    )
    from opake.profiling._tuner import TuneResult
else:
    try:
        from opake.core.errors import (
            ConfigurationError,
            InputTypeError,
            OpakeError,
            OperationError,
        )
    except ImportError:  # opake-core is not installed: same names, same builtin bases

        class OpakeError(Exception):
            """Base class of every error Opake raises on purpose."""

        class ConfigurationError(OpakeError, ValueError):
            """A value, option or combination of options is invalid (also a ``ValueError``)."""

        class InputTypeError(OpakeError, TypeError):
            """An argument has the wrong type (also a ``TypeError``)."""

        class OperationError(OpakeError, RuntimeError):
            """An operation cannot run in the current state or context (also a ``RuntimeError``)."""


class NoMicrobatchFitsError(OperationError):
    """No candidate microbatch size fitted; ``.result`` holds what every candidate measured."""

    def __init__(self, message: str, result: TuneResult | Any) -> None:
        super().__init__(message)
        self.result = result
