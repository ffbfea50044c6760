"""pytest for opake-transformers: the package's doctests run from tests/test_doctests.py.

Collecting ``src/opake/transformers/*.py`` by file path (``--doctest-modules``) would import the
package under the name ``transformers`` — its nearest folder without ``__init__.py`` is the
PEP 420 namespace ``opake`` — shadowing Hugging Face's ``transformers`` for the rest of the
run. The files are skipped here and their examples run through the real import name instead.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent / "src" / "opake" / "transformers"


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    path = collection_path.resolve()
    if path == _PACKAGE or _PACKAGE in path.parents:
        return True
    return None
