"""The ``opake`` command line: ``opake info``, ``train``, ``epsilon``, ``tune`` and ``bench``.

:func:`main` runs the command (``main(["train", "--steps", "10"])`` from Python);
:class:`ByteTokenizer` is the self-contained tokenizer ``opake train`` saves next to its models.

>>> from opake.cli import ByteTokenizer, main
>>> callable(main), ByteTokenizer().vocab_size
(True, 257)
"""

from __future__ import annotations

from collections.abc import Sequence

from opake.cli._tokenizer import ByteTokenizer
from opake.cli._version import __version__

__all__ = ["ByteTokenizer", "__version__", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``opake`` command; returns the process exit code.

    The command itself lives in ``opake.cli.__main__``, imported here on the first call only:
    importing it with the package would make ``python -m opake.cli`` warn (runpy finds the module
    already imported before it runs it).
    """
    from opake.cli.__main__ import main as run_command

    return run_command(argv)
