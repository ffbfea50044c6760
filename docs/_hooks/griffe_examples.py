"""A griffe extension for the API reference: ``Example:`` sections are examples.

Opake's docstrings (Google style) head their runnable examples ``Example:``; griffe's Google
parser only knows the plural ``Examples:`` and renders the singular as a plain admonition, whose
``>>>`` lines then read as Markdown (``x[0]`` becomes a broken reference link). This extension
renames the header when griffe loads an object, so the examples render as code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADER = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class SingularExamples(griffe.Extension):
    """Rewrite ``Example:`` section headers to ``Examples:``."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and "Example:" in obj.docstring.value:
            obj.docstring.value = _HEADER.sub(r"\1Examples:", obj.docstring.value)
