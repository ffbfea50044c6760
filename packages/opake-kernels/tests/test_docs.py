"""The kernels guide documents every op with its exact signature, and every backend."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import opake.kernels
from opake.core import ops
from opake.core.plugins import kernel_backends

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "guide" / "kernels.md"


@pytest.fixture(scope="module")
def guide() -> str:
    return GUIDE.read_text(encoding="utf-8")


def _signature(name: str) -> str:
    """``name(a, b, *, k=default)`` as the guide writes it (double-quoted strings)."""
    parts: list[str] = []
    star = False
    for p in inspect.signature(getattr(opake.kernels, name)).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.default is p.empty:
            parts.append(p.name)
        else:
            default = f'"{p.default}"' if isinstance(p.default, str) else repr(p.default)
            parts.append(f"{p.name}={default}")
    return f"{name}({', '.join(parts)})"


@pytest.mark.parametrize("op", ops.MODEL_OPS)
def test_every_op_is_documented_with_its_exact_signature(guide, op):
    assert f"`{_signature(op)}`" in guide, _signature(op)


def test_every_backend_is_documented(guide):
    for name in ("torch", "chunked", "triton"):
        assert name in kernel_backends()
        assert f"| `{name}`" in guide
    assert "## Adding a kernel backend" in guide
    assert "resolve_chunking(value, device, hidden, vocab, dtype" in guide
