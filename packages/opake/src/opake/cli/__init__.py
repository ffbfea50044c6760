"""The ``opake`` command line (``opake info``, and more subcommands as they land).

>>> from opake.cli import main
>>> callable(main)
True
"""

from __future__ import annotations

from opake.cli.__main__ import main
from opake.cli._version import __version__

__all__ = ["__version__", "main"]
