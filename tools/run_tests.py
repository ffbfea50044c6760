"""Run Opake's whole test suite (the command README.md and .ci/run use).

    python tools/run_tests.py                 # lint, every distribution's tests, integration, docs
    python tools/run_tests.py --package opake-core   # one distribution's tests only
    python tools/run_tests.py --only pytest   # just the pytest stage
    python tools/run_tests.py --only typecheck  # mypy --strict: every src/ and tools/bench/
    python tools/run_tests.py --workers 0     # pytest in this one process (no pytest-xdist)

Stages fail loudly: any failing stage makes the exit code non-zero, and pytest's exit code 5
("no tests collected") counts as a failure, never a silent pass.

Hypothesis runs its derandomized ``ci`` profile (``tests/hypothesis_profiles.py``, loaded by
pytest's ``addopts``): every run draws the same examples. ``OPAKE_HYPOTHESIS_PROFILE=explore``
makes the pytest stage an exploratory search instead (fresh random examples, more of them).

pytest runs on one worker process per CPU this process may use (``pytest-xdist``, each test
file on one worker, so module fixtures are built once): ``--workers N`` or
``OPAKE_TEST_WORKERS=N`` chooses another count, ``0`` runs every test in one process.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
STAGES = ("lint", "typecheck", "pytest", "docs")
#: the benchmark scripts ``opake bench`` runs and the opake wheel ships: typed like src/
BENCH = ROOT / "tools" / "bench"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on CPU in the interpreter
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("MPLBACKEND", "Agg")
    env.setdefault("PYTHONHASHSEED", "0")
    env.setdefault("NO_MKDOCS_2_WARNING", "1")
    env.setdefault("OPAKE_HYPOTHESIS_PROFILE", "ci")  # derandomized; "explore" opts in
    # tiny-model tests run several times faster on one intra-op thread on small machines
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def typecheck_command(python: str) -> list[str]:
    """``mypy --strict`` over every distribution's top-level module and every shipped benchmark
    script, ``tools/bench/*.py`` (both derived from the tree). The scripts are top-level modules
    of their folder (they import each other so), which :func:`typecheck_env` puts on mypy's
    path."""
    modules = sorted(
        f"opake.{sub.name}"
        for sub in ROOT.glob("packages/*/src/opake/*")
        if (sub / "__init__.py").exists()
    )
    scripts = sorted(path.stem for path in BENCH.glob("*.py"))
    packages = (arg for mod in modules for arg in ("-p", mod))
    return [python, "-m", "mypy", "--strict", *packages, *(a for s in scripts for a in ("-m", s))]


def typecheck_env() -> dict[str, str]:
    """What :func:`typecheck_command` needs in its environment: ``tools/bench`` as a module root,
    where ``-m x`` finds ``tools/bench/x.py`` and ``import _dpsgd_workload`` resolves."""
    paths = [str(BENCH), os.environ.get("MYPYPATH", "")]
    return {"MYPYPATH": os.pathsep.join(p for p in paths if p)}


def workers_arguments(workers: str | None) -> list[str]:
    """pytest-xdist's arguments for *workers* (default ``OPAKE_TEST_WORKERS``, else one per
    usable CPU): ``-n N --dist loadfile`` (a test file stays on one worker), none for 0 or 1.

    >>> workers_arguments("3")
    ['-n', '3', '--dist', 'loadfile']
    >>> workers_arguments("0")
    []
    """
    value = workers if workers is not None else os.environ.get("OPAKE_TEST_WORKERS")
    if value is None:
        count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        value = str(count or 1)
    if not value.isdigit():
        raise SystemExit(f"--workers / OPAKE_TEST_WORKERS must be a whole number, got {value!r}")
    n = int(value)
    return ["-n", str(n), "--dist", "loadfile"] if n > 1 else []


def _run(cmd: list[str], stage: str, extra_env: dict[str, str] | None = None) -> int:
    print(f"\n=== {stage}: {' '.join(cmd)}", flush=True)
    rc = subprocess.call(cmd, cwd=ROOT, env=_env() | (extra_env or {}))
    if stage.startswith("pytest") and rc == 5:
        print(f"=== {stage}: no tests were collected (pytest exit 5): FAIL", flush=True)
        return 1
    print(f"=== {stage}: {'ok' if rc == 0 else f'FAILED (exit {rc})'}", flush=True)
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", action="append", choices=[*PACKAGES, "integration"])
    parser.add_argument("--only", action="append", choices=STAGES)
    parser.add_argument(
        "--workers", help="pytest worker processes (default: one per usable CPU; 0: none)"
    )
    parser.add_argument("pytest_args", nargs="*", help="extra arguments for pytest")
    args = parser.parse_args(argv)
    stages = args.only or list(STAGES)
    failures = []
    py = sys.executable
    if "lint" in stages and not args.package:
        if _run([py, "-m", "ruff", "check", "."], "lint") != 0:
            failures.append("lint")
        if _run([py, "-m", "ruff", "format", "--check", "."], "format") != 0:
            failures.append("format")
    typecheck = "typecheck" in stages and not args.package
    if typecheck and _run(typecheck_command(py), "typecheck", typecheck_env()) != 0:
        failures.append("typecheck")
    if "pytest" in stages:
        selected = args.package or [*PACKAGES, "integration"]
        paths = []
        for name in selected:
            if name == "integration":
                paths.append("tests")
            else:
                paths += [f"packages/{name}/tests", f"packages/{name}/src"]
        paths = [p for p in paths if (ROOT / p).exists()]
        cmd = [py, "-m", "pytest", "--doctest-modules", "--durations=30"]
        cmd += [*workers_arguments(args.workers), *paths, *args.pytest_args]
        if _run(cmd, "pytest") != 0:
            failures.append("pytest")
    docs_cmd = [py, "-m", "mkdocs", "build", "--strict", "--site-dir", "build/site"]
    if "docs" in stages and not args.package and _run(docs_cmd, "docs") != 0:
        failures.append("docs")
    if failures:
        print(f"\nFAILED stages: {', '.join(failures)}", flush=True)
        return 1
    print("\nall stages passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
