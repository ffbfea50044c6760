"""Opake models (distribution `opake-models`).

>>> import opake.models
>>> opake.models.__version__
'0.1.0'
"""

from __future__ import annotations

from opake.models._version import __version__

__all__ = ["__version__"]
