"""Every distribution builds a wheel and an sdist that pass the content check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_all_wheels_build_and_pass_content_check(tmp_path):
    proc = subprocess.run(
        [sys.executable, "tools/check_wheels.py", "--build", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    count = len([p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists()])
    assert count >= 7
    wheels = sorted(p.name for p in tmp_path.glob("*.whl"))
    assert len(wheels) == count, wheels
    assert len(list(tmp_path.glob("*.tar.gz"))) == count
    assert proc.stdout.count("ok ") == count


def test_content_check_catches_a_namespace_init(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import check_wheels
    finally:
        sys.path.pop(0)
    import zipfile

    bad = tmp_path / "opake_core-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("opake/__init__.py", "")
        zf.writestr("opake/core/__init__.py", "")
        zf.writestr("opake_core-0.1.0.dist-info/METADATA", "Name: opake-core\n")
    problems = check_wheels.check_wheel("opake-core", ROOT / "packages" / "opake-core", bad)
    assert any("opake/__init__.py" in p for p in problems)
    assert any("py.typed" in p for p in problems)
