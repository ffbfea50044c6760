"""Opake core: the plugin manager, typed errors and shared utilities.

Importing :mod:`opake.core` is cheap: torch is imported only by the modules that need it
(:mod:`opake.dpsgd`, :mod:`opake.functional`).

>>> import opake.core
>>> opake.core.__version__
'0.1.0'
"""

from __future__ import annotations

from opake.core._version import __version__
from opake.core.errors import (
    ConfigurationError,
    InputTypeError,
    OpakeError,
    OpakePluginWarning,
    OpakePrivacyWarning,
    OperationError,
)

__all__ = [
    "ConfigurationError",
    "InputTypeError",
    "OpakeError",
    "OpakePluginWarning",
    "OpakePrivacyWarning",
    "OperationError",
    "__version__",
]
