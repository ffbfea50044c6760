"""Opake profiling (distribution `opake-profiling`).

>>> import opake.profiling
>>> opake.profiling.__version__
'0.1.0'
"""

from __future__ import annotations

from opake.profiling._version import __version__

__all__ = ["__version__"]
