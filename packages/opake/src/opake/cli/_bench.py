"""``opake bench``: run the benchmark scripts of ``tools/bench/`` and print their tables.

From a checkout the scripts are its ``tools/bench/``; a wheel of the ``opake`` distribution ships
the same scripts (as ``opake/cli/_bench_scripts/``), so the command also works where Opake is
installed from a wheel. The folder's ``_*.py`` files are helper modules the scripts import from
their own folder, not benchmarks; the developer profilers of ``tools/profile`` (which time
Opake's internals) are neither shipped nor run by this command.

Each script runs in a fresh Python process (so no state, warm cache or imported kernel leaks
between benchmarks); its standard output — the tables it records in ``docs/benchmarks.md`` — is
printed under a heading, its standard error (progress) passes through.

>>> import pathlib, tempfile
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> _ = (d / "b_two.py").write_text("print('| a |')")
>>> _ = (d / "a_one.py").write_text("print('| b |')")
>>> _ = (d / "_helpers.py").write_text("")
>>> [p.stem for p in find_scripts(d)]
['a_one', 'b_two']
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opake.core.errors import ConfigurationError

__all__ = ["SHIPPED_DIR", "find_bench_dir", "find_scripts", "register", "run_scripts"]

_log = logging.getLogger("opake.cli")


#: the benchmark scripts a wheel ships (``tools/bench/*.py`` of the checkout it was built from)
SHIPPED_DIR = Path(__file__).resolve().with_name("_bench_scripts")
#: where this module is installed (an editable install: inside the checkout)
_INSTALLED_AT = Path(__file__).resolve()


def find_bench_dir(start: Path | None = None) -> Path:
    """The benchmark scripts' directory: ``tools/bench`` of a checkout above *start* (default: the
    current directory), else the scripts an installed wheel ships, else ``tools/bench`` above this
    file (an editable install).

    Raises:
        ConfigurationError: none of them exists.
    """
    candidates = [
        *_checkout_benches(start or Path.cwd()),
        SHIPPED_DIR,
        *_checkout_benches(_INSTALLED_AT),
    ]
    for bench in candidates:
        if bench.is_dir():
            _log.info("opake bench: benchmark scripts from %s", bench)
            return bench
    raise ConfigurationError(
        "no benchmark scripts found: this installation ships none (it is not a wheel of the "
        "opake distribution) and no tools/bench directory is above the current directory; run "
        "opake bench from an Opake checkout, or pass --dir PATH/TO/tools/bench"
    )


def _checkout_benches(origin: Path) -> list[Path]:
    return [folder / "tools" / "bench" for folder in (origin, *origin.parents)]


def find_scripts(directory: Path) -> list[Path]:
    """The benchmark scripts in *directory*: ``*.py`` files not starting with ``_`` (those are
    the scripts' helper modules), by name."""
    return sorted(p for p in directory.glob("*.py") if not p.name.startswith("_"))


def run_scripts(
    scripts: Sequence[Path], *, extra_args: Sequence[str] = (), timeout: float | None = None
) -> dict[str, int]:
    """Run each script in a fresh interpreter, printing its stdout; returns exit codes by name.

    Each script runs in a process group of its own with a temporary directory of its own
    (``TMPDIR``); when it ends — or runs past *timeout* seconds (exit code 124) — the whole group
    (the script and every process it started) is killed and the directory removed.
    """
    codes: dict[str, int] = {}
    for script in scripts:
        print(f"## {script.stem}  ({script})", flush=True)
        code, stdout = _run_one([sys.executable, str(script), *extra_args], timeout)
        if code == _TIMED_OUT:
            print(f"(timed out after {timeout:g} s)\n", flush=True)
        else:
            print(stdout.rstrip() + "\n", flush=True)
        codes[script.stem] = code
    return codes


_TIMED_OUT = 124
#: seconds a process group gets to exit after SIGTERM before SIGKILL
_GRACE_SEC = 5.0


def _run_one(cmd: Sequence[str], timeout: float | None) -> tuple[int, str]:
    """Run *cmd* in its own process group and temporary directory; ``(exit code, stdout)``."""
    env = dict(os.environ)
    env.setdefault("MPLBACKEND", "Agg")
    scratch = tempfile.mkdtemp(prefix="opake-bench-")
    for name in ("TMPDIR", "TEMP", "TMP"):
        env[name] = scratch
    posix = os.name == "posix"
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, text=True, env=env, start_new_session=posix
    )
    try:
        stdout, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        stdout, code = "", _TIMED_OUT
    except BaseException:  # Ctrl-C: take the benchmark's processes down with us
        _kill_group(proc, posix)
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    _kill_group(proc, posix)  # also any child the script left running after it exited
    shutil.rmtree(scratch, ignore_errors=True)
    return code, stdout


def _kill_group(proc: subprocess.Popen[str], posix: bool) -> None:
    """SIGTERM the process group of *proc*, SIGKILL what is left after a grace period."""
    if not posix:
        if proc.poll() is None:
            proc.kill()
        _reap(proc)
        return
    import signal

    def signal_group(sig: int) -> bool:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False  # the group is gone
        return True

    if signal_group(signal.SIGTERM):
        deadline = time.monotonic() + _GRACE_SEC
        while time.monotonic() < deadline and signal_group(0):
            if proc.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.05)
            else:
                time.sleep(0.05)
        signal_group(signal.SIGKILL)
    _reap(proc)


def _reap(proc: subprocess.Popen[str]) -> None:
    if proc.stdout is not None and not proc.stdout.closed:
        proc.stdout.close()
    proc.wait()


def _run(args: argparse.Namespace) -> int:
    directory = Path(args.dir) if args.dir else find_bench_dir()
    if not directory.is_dir():
        raise ConfigurationError(f"--dir {args.dir}: not a directory; expected tools/bench")
    scripts = find_scripts(directory)
    if args.list:
        for script in scripts:
            doc = _first_doc_line(script)
            print(f"{script.stem:<28} {doc}")
        return 0
    by_name = {s.stem: s for s in scripts}
    chosen = []
    for name in args.names:
        key = Path(name).stem
        if key not in by_name:
            raise ConfigurationError(
                f"unknown benchmark {name!r}; available in {directory}: "
                f"{', '.join(by_name) or '(none)'}"
            )
        chosen.append(by_name[key])
    codes = run_scripts(chosen or scripts, extra_args=args.script_args, timeout=args.timeout)
    failed = [name for name, code in codes.items() if code != 0]
    if failed:
        print(f"opake bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _first_doc_line(script: Path) -> str:
    import ast

    try:
        doc = ast.get_docstring(ast.parse(script.read_text(encoding="utf-8")))
    except (SyntaxError, UnicodeDecodeError):
        return ""
    return doc.strip().splitlines()[0] if doc else ""


def register(sub: Any) -> None:
    """Add the ``bench`` subcommand to the ``opake`` parser."""
    p = sub.add_parser(
        "bench",
        help="run the benchmark scripts and print their tables",
        description=(
            "Run benchmark scripts (tools/bench/*.py of an Opake checkout, else the copies an "
            "installed wheel ships), each in a fresh process, and print the tables they produce."
        ),
    )
    p.add_argument("names", nargs="*", metavar="NAME", help="scripts to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the scripts and exit")
    p.add_argument(
        "--dir",
        help="the benchmark directory (default: tools/bench of the checkout, else the shipped one)",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds allowed per script")
    p.add_argument(
        "--script-args",
        type=shlex.split,
        default=[],
        metavar="ARGS",
        help='arguments for every script, one quoted string (e.g. --script-args "--quick")',
    )
    p.set_defaults(run=_run)
