"""Opake patches (distribution `opake-patches`).

>>> import opake.patches
>>> opake.patches.__version__
'0.1.0'
"""

from __future__ import annotations

from opake.patches._version import __version__

__all__ = ["__version__"]
