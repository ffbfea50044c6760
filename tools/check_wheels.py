"""Build (optionally) and check the wheel of every Opake distribution.

    python tools/check_wheels.py --build --out build/dist   # build wheels + sdists, then check
    python tools/check_wheels.py --out build/dist           # check wheels already there

A wheel passes when it holds only ``opake/<sub>/...`` files (plus its ``.dist-info``), never
``opake/__init__.py`` (the namespace is shared: PEP 420), ships ``py.typed`` in each leaf
package, and its metadata names the entry points declared in the distribution's pyproject.toml.
The ``opake`` wheel must also ship every ``tools/bench/*.py`` unchanged (``opake bench`` runs
them from an installed wheel). Then every wheel is installed (``--no-deps``, from the built files
only) into a fresh virtual environment outside the checkout, where ``opake bench --list`` must list
every script (``--no-install`` skips this step).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ROOT / "packages"
BENCH = ROOT / "tools" / "bench"
#: where the opake wheel ships the benchmark scripts (see packages/opake/hatch_build.py)
SHIPPED_BENCH = "opake/cli/_bench_scripts"


def distributions() -> dict[str, Path]:
    """Distribution name -> its folder under packages/."""
    out = {}
    for folder in sorted(PACKAGES.iterdir()):
        pyproject = folder / "pyproject.toml"
        if pyproject.exists():
            name = tomllib.loads(pyproject.read_text())["project"]["name"]
            out[name] = folder
    return out


def build(out: Path) -> None:
    """Build a wheel and an sdist of every distribution into *out* (no build isolation)."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name, folder in distributions().items():
        print(f"building {name}", flush=True)
        subprocess.run(
            [sys.executable, "-m", "hatchling", "build", "-d", str(out)], cwd=folder, check=True
        )


def _wheel_for(name: str, out: Path) -> Path:
    stem = name.replace("-", "_")
    found = sorted(out.glob(f"{stem}-*.whl"))
    if not found:
        raise SystemExit(f"no wheel for {name} in {out}; run with --build")
    return found[-1]


def check_wheel(name: str, folder: Path, wheel: Path) -> list[str]:
    """Return the problems found in *wheel* (empty when it passes)."""
    problems = []
    meta = tomllib.loads((folder / "pyproject.toml").read_text())
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = [n for n in names if ".dist-info/" in n]
        payload = [n for n in names if ".dist-info/" not in n]
        if "opake/__init__.py" in payload:
            problems.append("ships opake/__init__.py (breaks the PEP 420 namespace)")
        bad = [n for n in payload if not n.startswith("opake/") or n.count("/") < 2]
        if bad:
            problems.append(f"files outside opake/<sub>/: {bad[:5]}")
        subs = {n.split("/")[1] for n in payload if n.count("/") >= 2}
        problems.extend(
            f"opake/{sub}/py.typed missing"
            for sub in sorted(subs)
            if f"opake/{sub}/py.typed" not in payload
        )
        if not subs:
            problems.append("wheel contains no opake/<sub> package")
        declared = meta["project"].get("entry-points", {}).get("opake", {})
        scripts = meta["project"].get("scripts", {})
        ep_files = [n for n in dist_info if n.endswith("entry_points.txt")]
        ep_text = zf.read(ep_files[0]).decode() if ep_files else ""
        for ep_name, value in declared.items():
            if f"{ep_name} = {value}" not in ep_text:
                problems.append(f"entry point opake:{ep_name} = {value} missing from metadata")
        if declared and "[opake]" not in ep_text:
            problems.append("entry_points.txt has no [opake] group")
        for script, value in scripts.items():
            if f"{script} = {value}" not in ep_text:
                problems.append(f"console script {script} missing from metadata")
    return problems


def bench_scripts() -> list[Path]:
    """The benchmark scripts of the checkout (what ``opake bench`` runs)."""
    return sorted(BENCH.glob("*.py"))


def check_shipped_bench(wheel: Path) -> list[str]:
    """Problems with the benchmark scripts in the ``opake`` wheel: each script of tools/bench
    must be there, byte for byte, and nothing else."""
    problems = []
    with zipfile.ZipFile(wheel) as zf:
        shipped = {n for n in zf.namelist() if n.startswith(SHIPPED_BENCH + "/")}
        expected = {f"{SHIPPED_BENCH}/{s.name}" for s in bench_scripts()}
        problems.extend(f"benchmark script missing: {n}" for n in sorted(expected - shipped))
        problems.extend(f"unexpected benchmark file: {n}" for n in sorted(shipped - expected))
        problems.extend(
            f"{SHIPPED_BENCH}/{s.name} differs from tools/bench/{s.name}"
            for s in bench_scripts()
            if f"{SHIPPED_BENCH}/{s.name}" in shipped
            and zf.read(f"{SHIPPED_BENCH}/{s.name}") != s.read_bytes()
        )
    return problems


def check_installed_bench(wheels: list[Path]) -> list[str]:
    """Install *wheels* (no dependencies, no index) into a fresh venv outside the checkout and
    run ``opake bench --list`` there; problems found (empty when every script is listed)."""
    with tempfile.TemporaryDirectory(prefix="opake-wheel-check-") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        bindir = venv / ("Scripts" if sys.platform == "win32" else "bin")
        python = next(p for p in (bindir / "python", bindir / "python.exe") if p.exists())
        install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
        subprocess.run([*install, "--no-deps", "--no-index", *map(str, wheels)], check=True)
        opake = next((p for p in (bindir / "opake", bindir / "opake.exe") if p.exists()), None)
        if opake is None:
            return ["the wheels installed no opake console script"]
        proc = subprocess.run(
            [str(opake), "bench", "--list"],  # the console script the wheel installs
            cwd=tmp,
            capture_output=True,
            text=True,
            check=False,
        )
    if proc.returncode != 0:
        return [f"opake bench --list failed in a fresh install: {proc.stderr.strip()}"]
    listed = {line.split()[0] for line in proc.stdout.splitlines() if line.strip()}
    return [
        f"opake bench --list in a fresh install does not list {s.stem}"
        for s in bench_scripts()
        if not s.name.startswith("_") and s.stem not in listed  # _*.py: the scripts' helpers
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="build and check Opake wheels")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "dist")
    parser.add_argument("--build", action="store_true", help="build wheels and sdists first")
    parser.add_argument(
        "--no-install",
        action="store_true",
        help="skip installing the wheels in a fresh venv (where opake bench --list must work)",
    )
    args = parser.parse_args(argv)
    if args.build:
        build(args.out)
    failed = False
    wheels = []
    for name, folder in distributions().items():
        wheel = _wheel_for(name, args.out)
        wheels.append(wheel)
        problems = check_wheel(name, folder, wheel)
        if name == "opake":
            problems.extend(check_shipped_bench(wheel))
        sdists = sorted(args.out.glob(f"{name.replace('-', '_')}-*.tar.gz"))
        if args.build and not sdists:
            problems.append("no sdist was built")
        status = "ok" if not problems else "FAIL"
        print(f"{status:4} {wheel.name}")
        for p in problems:
            print(f"     - {p}")
        failed |= bool(problems)
    if not args.no_install:
        problems = check_installed_bench(wheels)
        verdict = "passes" if not problems else "FAIL"
        print(f"installed wheels, opake bench --list outside the checkout: {verdict}")
        for p in problems:
            print(f"     - {p}")
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
