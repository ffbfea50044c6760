"""``opake bench`` outside a checkout: the scripts a wheel ships, and the error without any; what
ships (tools/bench, public API only, typed, sized like src/ files; nothing of tools/profile)."""

from __future__ import annotations

import ast
import importlib.util
import itertools
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from opake.cli import _bench
from opake.cli.__main__ import main
from opake.core.errors import ConfigurationError


@pytest.fixture
def nowhere(tmp_path, monkeypatch):
    """A working directory and an install location with no tools/bench above them."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(_bench, "_INSTALLED_AT", tmp_path / "site-packages" / "opake" / "cli")
    monkeypatch.setattr(_bench, "SHIPPED_DIR", tmp_path / "site-packages" / "missing")
    return tmp_path


def test_bench_uses_the_shipped_scripts_outside_a_checkout(nowhere, monkeypatch, capsys, caplog):
    shipped = nowhere / "site-packages" / "opake" / "cli" / "_bench_scripts"
    shipped.mkdir(parents=True)
    (shipped / "step.py").write_text('"""Step: a shipped benchmark."""\nprint("| shipped |")\n')
    monkeypatch.setattr(_bench, "SHIPPED_DIR", shipped)
    with caplog.at_level(logging.INFO, logger="opake.cli"):
        assert main(["bench", "--list"]) == 0
    assert capsys.readouterr().out.split() == ["step", "Step:", "a", "shipped", "benchmark."]
    assert f"benchmark scripts from {shipped}" in caplog.text
    assert main(["bench", "step"]) == 0
    assert "| shipped |" in capsys.readouterr().out


def test_a_checkout_above_the_working_directory_wins_over_the_shipped_scripts(nowhere, monkeypatch):
    shipped = nowhere / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(_bench, "SHIPPED_DIR", shipped)
    checkout = nowhere / "work" / "tools" / "bench"
    checkout.mkdir(parents=True)
    monkeypatch.chdir(checkout)
    assert _bench.find_bench_dir() == checkout


def test_bench_without_any_scripts_says_how_to_fix_it(nowhere, capsys):
    with pytest.raises(ConfigurationError, match="pass --dir PATH/TO/tools/bench"):
        _bench.find_bench_dir()
    assert main(["bench", "--list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opake bench: error: no benchmark scripts found")
    assert len(err.splitlines()) == 1


# --------------------------------------------------------------------------- what ships
# The scripts a wheel ships follow the package rules: Opake's public API only, typed (the
# typecheck stage of tools/run_tests.py runs mypy --strict on them), and sized like src/ files,
# with the same margin below the limit. Developer profilers that time Opake's internals live in
# tools/profile and never ship.

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "tools" / "bench"
PROFILE = ROOT / "tools" / "profile"
SHIPPED = sorted(BENCH.glob("*.py"))
#: a shipped file stays this many lines below the size limit of src/ files
SIZE_MARGIN = 20
_DOTTED = re.compile(r"opake(\.\w+)+")

in_a_checkout = pytest.mark.skipif(
    not BENCH.is_dir() or not (ROOT / "tests" / "test_layout.py").is_file(),
    reason="needs an Opake checkout (tools/bench, tests/test_layout.py)",
)


def _is_private(dotted: str) -> bool:
    """An ``opake`` name with a component starting with ``_`` (dunders like ``__version__``
    are public)."""
    parts = dotted.split(".")
    return parts[0] == "opake" and any(
        part.startswith("_") and not (part.startswith("__") and part.endswith("__"))
        for part in parts[1:]
    )


def _dotted(node: ast.expr, bound: dict[str, str]) -> str | None:
    """``a.b.c`` of an attribute chain whose root is ``opake`` or a name bound to an Opake name."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    root = bound.get(node.id, "opake" if node.id == "opake" else None)
    return None if root is None else ".".join([root, *reversed(attrs)])


def private_opake_names(path: Path) -> list[str]:
    """Every private ``opake`` name *path* reaches: imported (``import``, ``from ... import``),
    read as an attribute of an imported Opake name, or spelled as a dotted string (what
    ``importlib.import_module`` or a monkeypatch table takes)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bound: dict[str, str] = {}  # local name -> the Opake name it holds
    used: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                used.append(alias.name)
                if alias.asname:
                    bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                used.append(f"{node.module}.{alias.name}")
                if node.module.split(".")[0] == "opake":
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            used.append(_dotted(node, bound) or "")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            used.append(node.value if _DOTTED.fullmatch(node.value) else "")
    return sorted({name for name in used if _is_private(name)})


def test_the_check_sees_private_opake_names(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import opake.kernels._plugin as plugin\n"
        "import opake.profiling\n"
        "from opake.dpsgd.bookkeeping import _runner, BatchedLoss\n"
        "from opake.cli import main, __version__\n"
        "from other._private import thing\n"
        "BatchedLoss._fields\n"
        "opake.profiling._memory._backend\n"
        "opake.profiling.step_perf\n"
        "TABLE = ('opake.models.bookkeeping._record', 'opake.models', 'not opake._x')\n",
        encoding="utf-8",
    )
    assert private_opake_names(sample) == [
        "opake.dpsgd.bookkeeping.BatchedLoss._fields",
        "opake.dpsgd.bookkeeping._runner",
        "opake.kernels._plugin",
        "opake.models.bookkeeping._record",
        "opake.profiling._memory",
        "opake.profiling._memory._backend",
    ]


@in_a_checkout
@pytest.mark.parametrize("script", SHIPPED, ids=lambda p: p.name)
def test_a_shipped_script_uses_public_api_only(script):
    assert not private_opake_names(script), (
        "a shipped benchmark uses Opake's public API only; a developer profiler that needs "
        "internals goes to tools/profile (see its README.md)"
    )


@in_a_checkout
@pytest.mark.parametrize("script", SHIPPED, ids=lambda p: p.name)
def test_a_shipped_script_is_sized_like_the_sources(script):
    from tests.test_layout import MAX_FILE_LINES, long_functions

    lines = script.read_text(encoding="utf-8").count("\n")
    assert lines < MAX_FILE_LINES - SIZE_MARGIN, f"{lines} lines: split it by concept"
    assert not long_functions(script), "functions over the limit: " + ", ".join(
        long_functions(script)
    )


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@in_a_checkout
def test_the_typecheck_stage_covers_every_shipped_script():
    run_tests = _load(ROOT / "tools" / "run_tests.py", "opake_run_tests")
    command = run_tests.typecheck_command("python")
    assert "--strict" in command
    pairs = itertools.pairwise(command[command.index("--strict") :])  # after python -m mypy
    checked = {BENCH / f"{name}.py" for flag, name in pairs if flag == "-m"}
    assert checked == set(SHIPPED)
    assert str(BENCH) in run_tests.typecheck_env()["MYPYPATH"].split(os.pathsep)


def _build_hook(target: str) -> Any:
    path = ROOT / "packages" / "opake" / "hatch_build.py"
    module = _load(path, "opake_hatch_build")
    root = str(path.parent)
    return module.BenchScriptsHook(root, {}, None, None, root, target)


@in_a_checkout
@pytest.mark.parametrize(
    ("target", "folder"), [("wheel", "opake/cli/_bench_scripts"), ("sdist", "bench")]
)
def test_the_build_hook_ships_exactly_the_bench_modules(target, folder):
    pytest.importorskip("hatchling")
    build_data: dict[str, Any] = {"force_include": {}}
    _build_hook(target).initialize("standard", build_data)
    assert build_data["force_include"] == {str(p): f"{folder}/{p.name}" for p in SHIPPED}
    assert any(p.name.startswith("_") for p in SHIPPED)  # the helper modules ship too
    assert not set(build_data["force_include"]) & {str(p) for p in PROFILE.glob("*.py")}


@in_a_checkout
def test_opake_bench_lists_the_benchmarks_not_their_helpers(capsys):
    assert main(["bench", "--dir", str(BENCH), "--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == [p.stem for p in SHIPPED if not p.name.startswith("_")]


def _sibling_imports(script: Path) -> set[str]:
    modules = {p.stem for p in SHIPPED}
    found = set()
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module in modules:
            found.add(node.module)
    return found


@in_a_checkout
def test_scripts_find_their_helpers_in_the_copy_a_wheel_ships(tmp_path):
    """From ``opake/cli/_bench_scripts`` (outside any checkout) a script that imports a sibling
    module still starts: its own folder is where the sibling is found."""
    shipped = tmp_path / "site-packages" / "opake" / "cli" / "_bench_scripts"
    shipped.mkdir(parents=True)
    for path in SHIPPED:
        shutil.copy(path, shipped / path.name)
    importers = [p for p in SHIPPED if not p.name.startswith("_") and _sibling_imports(p)]
    assert "dpsgd_step.py" in {p.name for p in importers}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    for script in importers:
        done = subprocess.run(
            [sys.executable, str(shipped / script.name), "--help"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, f"{script.name}: {done.stderr[-2000:]}"
        assert "usage:" in done.stdout
