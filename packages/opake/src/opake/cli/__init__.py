"""The ``opake`` command line: ``opake info``, ``train``, ``epsilon``, ``tune`` and ``bench``.

:func:`main` runs the command (``main(["train", "--steps", "10"])`` from Python);
:class:`ByteTokenizer` is the self-contained tokenizer ``opake train`` saves next to its models.

>>> from opake.cli import ByteTokenizer, main
>>> callable(main), ByteTokenizer().vocab_size
(True, 257)
"""

from __future__ import annotations

from opake.cli.__main__ import main
from opake.cli._tokenizer import ByteTokenizer
from opake.cli._version import __version__

__all__ = ["ByteTokenizer", "__version__", "main"]
