"""Fixtures for cross-distribution tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_PLUGIN = ROOT / "tests" / "fixtures" / "opake-example-plugin"


@pytest.fixture(scope="session")
def example_plugin_site(tmp_path_factory) -> Path:
    """A directory with the example third-party plugin installed (pip --target, no deps)."""
    target = tmp_path_factory.mktemp("example-plugin-site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--target",
            str(target),
            str(EXAMPLE_PLUGIN),
        ],
        check=True,
    )
    return target


def run_python(code: str, *, path: Path | None = None, env: dict[str, str] | None = None):
    """Run *code* in a fresh interpreter (optionally with *path* on PYTHONPATH)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("OPAKE_")}
    if path is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(path), full_env.get("PYTHONPATH", "")) if p
        )
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, check=False
    )


def run_json(code: str, **kwargs):
    """Run *code* (which prints one JSON document) and return the parsed result."""
    proc = run_python(code, **kwargs)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)
