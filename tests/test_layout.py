"""The source tree keeps the shape the style guide promises: small modules, short functions.

Every ``packages/*/src`` file stays under 500 lines and every function under 80 lines of code (its
docstring not counted). The one exception is the CLI's argument table, a flat list of
``add_argument`` calls that reads best in one place.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(ROOT.glob("packages/*/src/**/*.py"))
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
#: (file name, function name) pairs allowed to be longer: tables, not logic
LONG_FUNCTION_EXCEPTIONS = {("_settings.py", "add_train_arguments")}


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    assert node.end_lineno is not None
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        assert first.end_lineno is not None
        lines -= first.end_lineno - first.lineno + 1
    return lines


def long_functions(path: Path) -> list[str]:
    """``name (N lines)`` for every function of *path* longer than the limit."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if (path.name, node.name) in LONG_FUNCTION_EXCEPTIONS:
                continue
            lines = _code_lines(node)
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{node.name} (line {node.lineno}, {lines} lines)")
    return found


def test_sources_found() -> None:
    assert len(SOURCES) > 100


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT / "packages")))
def test_module_is_small(path: Path) -> None:
    lines = path.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_FILE_LINES, f"{lines} lines: split it by concept"
    assert not long_functions(path), "functions over 80 lines of code: " + ", ".join(
        long_functions(path)
    )


def test_the_check_sees_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1))
    sample = tmp_path / "sample.py"
    sample.write_text(f'def f():\n    """Doc."""\n{body}\n    return 0\n', encoding="utf-8")
    assert long_functions(sample) == ["f (line 1, 81 lines)"]
    sample.write_text(f'def f():\n    """Doc."""\n{body}\n', encoding="utf-8")
    assert long_functions(sample) == []


def undecorated_functions(path: Path) -> list[str]:
    """Every ``torch.autograd.Function`` subclass of *path* that defines ``setup_context`` but
    is not decorated with ``cached_signature`` (its ``apply`` derives a signature per call)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ClassDef):
            continue
        bases = {ast.unparse(base) for base in node.bases}
        methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        if "torch.autograd.Function" not in bases or "setup_context" not in methods:
            continue
        if "cached_signature" not in {ast.unparse(d) for d in node.decorator_list}:
            found.append(f"{node.name} (line {node.lineno})")
    return found


def test_autograd_functions_cache_their_signature() -> None:
    missing = {str(p.relative_to(ROOT)): undecorated_functions(p) for p in SOURCES}
    assert not {k: v for k, v in missing.items() if v}, (
        "decorate with opake.functional.cached_signature"
    )


def test_the_check_sees_an_undecorated_function(tmp_path: Path) -> None:
    body = (
        "class F(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(x):\n        return x\n"
        "    @staticmethod\n    def setup_context(ctx, inputs, output):\n        pass\n"
    )
    sample = tmp_path / "sample.py"
    sample.write_text(body, encoding="utf-8")
    assert undecorated_functions(sample) == ["F (line 1)"]
    sample.write_text("@cached_signature\n" + body, encoding="utf-8")
    assert undecorated_functions(sample) == []
