"""nox sessions: one per distribution, plus integration, lint, typecheck, build and docs.

``nox`` builds an isolated environment per session (torch pinned, Opake's distributions installed
by local path in one pip command). ``nox --no-venv`` runs every session in the current environment
(built once with ``pip install -r requirements/dev.txt``), which is what fits a 2-core CI machine.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import nox
from packaging.requirements import Requirement

ROOT = Path(__file__).parent
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
TEST_TOOLS = ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "hypothesis>=6.100"]


def _pin(name: str) -> str:
    """The exact pin of *name* in requirements/dev.txt (torch and triton: a range pulls CUDA)."""
    for line in (ROOT / "requirements" / "dev.txt").read_text().splitlines():
        req = line.split("#", 1)[0].strip()
        if req.startswith(f"{name}=="):
            return req
    raise LookupError(f"requirements/dev.txt pins no {name}==...")


def _project(package: str) -> dict[str, Any]:
    with open(ROOT / "packages" / package / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _local_closure(package: str) -> list[str]:
    """*package* and every Opake distribution it or its ``test`` extra needs (transitively)."""
    seen: list[str] = []
    todo = [package]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.append(name)
        project = _project(name)
        reqs = list(project.get("dependencies", []))
        if name == package:
            reqs += project.get("optional-dependencies", {}).get("test", [])
        for req in reqs:
            dist = Requirement(req).name
            if dist in PACKAGES:
                todo.append(dist)
    return seen


nox.options.sessions = ["lint", "typecheck", "tests", "integration", "build", "docs"]


def _reusing(session: nox.Session) -> bool:
    return session.venv_backend == "none"


def _install(session: nox.Session, *args: str) -> None:
    """pip install inside the session's venv; a no-op when reusing the current environment."""
    if not _reusing(session):
        session.install(*args)


def _local(package: str) -> list[str]:
    """pip arguments installing *package* (with its ``test`` extra) and its Opake dependencies
    by local path, so pip never resolves an ``opake-*`` name from the package index."""
    out = ["-e", f"{ROOT / 'packages' / package}[test]"]
    for name in _local_closure(package)[1:]:
        out += ["-e", str(ROOT / "packages" / name)]
    return out


@nox.session
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """One distribution's own tests and doctests, in its own environment."""
    pins = [_pin("torch"), _pin("triton")]
    _install(session, *pins, *TEST_TOOLS, *_local(package))
    session.run("python", "tools/run_tests.py", "--only", "pytest", "--package", package)


@nox.session
def integration(session: nox.Session) -> None:
    """Cross-distribution tests (all distributions + the example third-party plugin)."""
    _install(session, "-r", "requirements/dev.txt")
    session.run("python", "tools/run_tests.py", "--only", "pytest", "--package", "integration")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff lint and format check (the same stage as CI)."""
    _install(session, "ruff>=0.6")
    session.run("python", "tools/run_tests.py", "--only", "lint")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over every distribution's src/ (the same stage as CI)."""
    _install(session, "-r", "requirements/dev.txt")
    session.run("python", "tools/run_tests.py", "--only", "typecheck")


@nox.session
def build(session: nox.Session) -> None:
    """Wheels and sdists of every distribution, then a content check of each wheel."""
    _install(session, "build>=1.2", "hatchling>=1.18")
    out = ROOT / "build" / "dist"
    session.run("python", "tools/check_wheels.py", "--build", "--out", str(out))


@nox.session
def docs(session: nox.Session) -> None:
    """mkdocs build --strict."""
    _install(session, "-r", "requirements/dev.txt")
    session.run("python", "tools/run_tests.py", "--only", "docs")
