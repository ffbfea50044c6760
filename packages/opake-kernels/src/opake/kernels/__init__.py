"""Opake kernels: vmap-native kernel backends registered through the ``opake`` plugin hooks.

>>> import opake.kernels
>>> opake.kernels.__version__
'0.1.0'
"""

from __future__ import annotations

from opake.kernels._version import __version__

__all__ = ["__version__"]
