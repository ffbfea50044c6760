"""Run documentation examples, each by itself, as a reader pasting it into a fresh ``python`` would.

    python tests/_docs_runner.py JOBS.json RESULTS.json

``JOBS.json`` is a list of ``{"id": ..., "code": ...}``. Each example is written to
``example.py`` in its own empty temporary directory and run there as ``__main__``
(``runpy.run_path``): a new namespace holding nothing but what the example itself defines or
imports — no prelude, no name from another example. ``RESULTS.json`` maps each id to
``{"rc": ..., "output": ..., "seconds": ..., "cpu_seconds": ...}`` (wall time, and the CPU time
of the example's process with the processes it waited for).

``import torch`` costs ~2 s of CPU and ``from transformers import LlamaForCausalLM`` ~4 s more, per
example. To save that, the examples run in processes forked from this one after it has imported
the modules in :data:`PRELOAD` (modules in ``sys.modules`` only, never a name in an example's
namespace: an example that forgets an import still fails). It forks only while it runs a single
thread (``OMP_NUM_THREADS=1``, as the test suite sets); otherwise, where ``fork`` is missing, or
with ``DOCS_TEST_FRESH_INTERPRETER=1``, every example gets a new interpreter instead.
``DOCS_TEST_JOBS`` examples run at a time (default: 2, or 1 on a single core);
``DOCS_TEST_TIMEOUT`` bounds each (300 s); ``DOCS_TEST_PRELOAD`` (comma-separated) replaces
:data:`PRELOAD`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_OUTPUT_TAIL = 6000
#: third-party modules imported once, before the examples are forked
PRELOAD = ("torch", "transformers.modeling_utils", "transformers.models.llama.modeling_llama")


def _child(path: Path) -> None:
    """In the forked process: become a fresh ``python example.py`` as far as names go."""
    import atexit
    import runpy
    import traceback

    os.setsid()  # its own process group: a timeout kills whatever it started too
    os.chdir(path.parent)
    log = os.open(path.parent / "output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.argv = [str(path)]
    sys.path[0] = str(path.parent)
    code = 0
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # report anything the example raised, as python would
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what interpreter shutdown runs: logging, temporary files, ...
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _start(path: Path, fresh: bool) -> int | subprocess.Popen:
    if fresh and not hasattr(os, "fork"):
        with open(path.parent / "output.txt", "wb") as log:
            return subprocess.Popen(
                [sys.executable, path.name],
                cwd=path.parent,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        try:
            if fresh:
                _exec(path)
            _child(path)
        finally:
            os._exit(1)
    return pid


def _exec(path: Path) -> None:
    """In the forked process: replace it by a new ``python example.py``."""
    os.setsid()
    os.chdir(path.parent)
    log = os.open(path.parent / "output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.execv(sys.executable, [sys.executable, path.name])


def _poll(handle: int | subprocess.Popen) -> tuple[int | None, float | None]:
    """(exit code or None while running, CPU seconds of the example's process)."""
    if isinstance(handle, subprocess.Popen):
        return handle.poll(), None
    pid, status, usage = os.wait4(handle, os.WNOHANG)
    if pid == 0:
        return None, None
    return os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime


def _kill(handle: int | subprocess.Popen) -> None:
    pid = handle.pid if isinstance(handle, subprocess.Popen) else handle
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    if isinstance(handle, subprocess.Popen):
        handle.wait()
    else:
        os.waitpid(pid, 0)


def _preload() -> bool:
    """Import :data:`PRELOAD`; whether this process may still fork (one thread only)."""
    import importlib
    import threading

    names = os.environ.get("DOCS_TEST_PRELOAD")
    for name in PRELOAD if names is None else filter(None, names.split(",")):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    tasks = Path("/proc/self/task")
    threads = len(list(tasks.iterdir())) if tasks.is_dir() else threading.active_count()
    return threads == 1


def run_examples(jobs: list[dict[str, str]], workdir: Path) -> dict[str, dict[str, object]]:
    fresh = bool(os.environ.get("DOCS_TEST_FRESH_INTERPRETER")) or not hasattr(os, "fork")
    if not fresh:
        fresh = not _preload()

    parallel = int(os.environ.get("DOCS_TEST_JOBS", "0")) or min(2, os.cpu_count() or 1)
    timeout = float(os.environ.get("DOCS_TEST_TIMEOUT", "300"))
    pending = list(enumerate(jobs))
    running: dict[str, tuple[int | subprocess.Popen, Path, float]] = {}
    results: dict[str, dict[str, object]] = {}
    while pending or running:
        while pending and len(running) < parallel:
            index, job = pending.pop(0)
            folder = workdir / f"example-{index}"
            folder.mkdir()
            path = folder / "example.py"
            path.write_text(job["code"], encoding="utf-8")
            running[job["id"]] = (_start(path, fresh), path, time.monotonic())
        time.sleep(0.02)
        for job_id, (handle, path, started) in list(running.items()):
            rc, cpu = _poll(handle)
            if rc is None and time.monotonic() - started > timeout:
                _kill(handle)
                rc = 124
            if rc is None:
                continue
            output = (path.parent / "output.txt").read_text(encoding="utf-8", errors="replace")
            if rc == 124:
                output += f"\n[docs test] killed after {timeout:.0f} s"
            results[job_id] = {
                "rc": rc,
                "output": output[-_OUTPUT_TAIL:],
                "seconds": round(time.monotonic() - started, 2),
                "cpu_seconds": None if cpu is None else round(cpu, 2),
            }
            del running[job_id]
    return results


def main(argv: list[str]) -> int:
    jobs = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    # not TemporaryDirectory: its exit-time finalizer would run in every forked example too
    workdir = Path(tempfile.mkdtemp(prefix="docs-examples-"))
    try:
        results = run_examples(jobs, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    Path(argv[1]).write_text(json.dumps(results), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
