"""The ``opake`` command starts without torch or numpy (an installed wheel lists its benchmarks)."""

from __future__ import annotations

import subprocess
import sys

BLOCK = "import sys\nfor m in ('numpy', 'torch', 'transformers', 'triton'): sys.modules[m] = None\n"


def test_the_command_parser_imports_without_heavy_dependencies() -> None:
    code = BLOCK + "from opake.cli.__main__ import build_parser\nprint(build_parser().prog)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
