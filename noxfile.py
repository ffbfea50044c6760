"""nox sessions: one per distribution, plus integration, lint, typecheck, build and docs.

``nox`` builds an isolated environment per session (torch pinned, Opake's distributions installed
by local path in one pip command). ``nox --no-venv`` runs every session in the current environment
(built once with ``pip install -r requirements/dev.txt``), which is what fits a 2-core CI machine.
"""

from __future__ import annotations

from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
TORCH = "torch==2.13.0"
TRITON = "triton==3.7.1"
TEST_TOOLS = ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100"]
# what each distribution needs (by local path), besides itself
LOCAL_DEPS = {
    "opake-core": ["opake-profiling"],
    "opake-patches": ["opake-core", "opake-kernels"],
    "opake-kernels": ["opake-core"],
    "opake-profiling": ["opake-core"],
    "opake-models": ["opake-core", "opake-patches", "opake-kernels"],
    "opake-auditing": ["opake-core"],
    "opake-transformers": ["opake-core", "opake-profiling"],
    "opake": [
        "opake-core",
        "opake-patches",
        "opake-kernels",
        "opake-profiling",
        "opake-models",
        "opake-auditing",
        "opake-transformers",
    ],
}
EXTRA_DEPS = {
    "opake-core": ["dp-accounting==0.6.0", "peft>=0.13", "transformers>=5.17,<6"],
    "opake-kernels": [TRITON],
    "opake-patches": ["transformers>=5.17,<6", "peft>=0.13"],
    "opake-models": ["transformers>=5.17,<6", "peft>=0.13", TRITON],
    "opake-auditing": ["matplotlib>=3.7"],
    "opake-transformers": ["transformers>=5.17,<6", "accelerate>=1.0", "peft>=0.13"],
    "opake": ["transformers>=5.17,<6", "peft>=0.13", "matplotlib>=3.7"],
}

nox.options.sessions = ["lint", "tests", "integration", "build", "docs"]


def _reusing(session: nox.Session) -> bool:
    return session.venv_backend == "none"


def _install(session: nox.Session, *args: str) -> None:
    """pip install inside the session's venv; a no-op when reusing the current environment."""
    if not _reusing(session):
        session.install(*args)


def _local(*names: str) -> list[str]:
    out = []
    for name in names:
        out += ["-e", str(ROOT / "packages" / name)]
    return out


@nox.session
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """One distribution's own tests and doctests, in its own environment."""
    deps = [*LOCAL_DEPS[package], package]
    _install(session, TORCH, *TEST_TOOLS, *EXTRA_DEPS.get(package, []), *_local(*deps))
    session.run("python", "tools/run_tests.py", "--only", "pytest", "--package", package)


@nox.session
def integration(session: nox.Session) -> None:
    """Cross-distribution tests (all distributions + the example third-party plugin)."""
    _install(session, "-r", "requirements/dev.txt")
    session.run("python", "tools/run_tests.py", "--only", "pytest", "--package", "integration")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check over the whole repository."""
    _install(session, "ruff>=0.6")
    session.run("python", "-m", "ruff", "check", ".")
    session.run("python", "-m", "ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over every distribution's src/."""
    _install(session, "-r", "requirements/dev.txt")
    modules = [
        "opake.core",
        "opake.dpsgd",
        "opake.functional",
        "opake.accounting",
        "opake.patches",
        "opake.kernels",
        "opake.profiling",
        "opake.models",
        "opake.auditing",
        "opake.transformers",
        "opake.cli",
    ]
    args = [arg for mod in modules for arg in ("-p", mod)]
    session.run("python", "-m", "mypy", *args)


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
