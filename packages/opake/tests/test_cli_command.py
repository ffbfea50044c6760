"""The ``opake`` command as a user runs it: ``--version``, ``python -m opake.cli``, ``opake bench``
timeouts and arguments, progress output in a log file, and one-line error messages."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from opake.cli import __version__, main
from opake.cli._progress import LineProgress, make_progress


def _opake(*args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess[str]:
    """``python -W error -m opake.cli ARGS``: the real command, warnings fatal."""
    return subprocess.run(
        [sys.executable, "-W", "error", "-m", "opake.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        **kwargs,
    )


def test_version_and_python_m_run_without_warning():
    proc = _opake("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"opake {__version__}"
    assert proc.stderr == ""  # no runpy RuntimeWarning (it was fatal under -W error)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find processes")
def test_bench_timeout_kills_the_script_and_its_children_and_cleans_up(tmp_path):
    bench = tmp_path / "bench"
    bench.mkdir()
    record = tmp_path / "record"
    (bench / "echo_args.py").write_text(
        '"""Prints its arguments."""\nimport sys\nprint("args", sys.argv[1:])\n'
    )
    (bench / "sleepy.py").write_text(
        textwrap.dedent(
            f'''\
            """Starts a child, makes a temporary run folder, then hangs."""
            import subprocess, sys, tempfile, time
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
            folder = tempfile.mkdtemp(prefix="run-")
            with open({str(record)!r}, "w") as f:
                f.write(f"{{child.pid}}\\n{{folder}}\\n")
            time.sleep(300)
            '''
        )
    )
    started = time.monotonic()
    # --script-args "--help" as the CLI guide writes it: a value starting with "--"
    proc = _opake(
        "bench", "echo_args", "sleepy", "--dir", str(bench), "--timeout", "8",
        "--script-args", "--help",
    )  # fmt: skip
    assert time.monotonic() - started < 60
    assert proc.returncode == 1, proc.stderr
    assert "args ['--help']" in proc.stdout
    assert "(timed out after 8 s)" in proc.stdout
    assert "failed: sleepy" in proc.stderr
    child_pid, folder = record.read_text().split()
    assert not _alive(int(child_pid)), "the script's child outlived the timeout"
    assert not Path(folder).exists(), "the script's temporary folder was left behind"


def test_unreachable_epsilon_names_no_truncation(capsys):
    argv = ["epsilon", "-q", "1", "-e", "0.001", "-t", "100000", "-d", "1e-10"]
    assert main([*argv, "--accountant", "rdp"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert "unreachable" in err
    assert "truncation" not in err


@pytest.mark.slow
def test_progress_in_a_log_file_and_a_lora_run_as_the_next_model(tiny_args, tmp_path):
    """A log got hundreds of carriage-return bar updates; a LoRA run's model/ was an adapter
    alone, which --model refused ("no config.json")."""
    log = tmp_path / "train.log"
    argv = [a for a in tiny_args("--steps", "3", "--lora-r", "2") if a != "--no-progress"]
    with log.open("w") as handle:
        proc = subprocess.run(
            [sys.executable, "-m", "opake.cli", *argv],
            stdout=subprocess.DEVNULL,
            stderr=handle,
            timeout=300,
            check=False,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    text = log.read_text()
    assert proc.returncode == 0, text
    assert "\r" not in text
    steps = [line for line in text.splitlines() if line.startswith("opake train: step ")]
    assert [line.split()[3] for line in steps] == ["1/3", "2/3", "3/3"]
    assert all("loss" in line and "ε" in line for line in steps)
    # the LoRA run's merged model is the next run's --model (here the run's folder: its model/)
    # and starts where the trained model ended: the same validation loss
    run, again = tmp_path / "run", tmp_path / "again"
    assert main(tiny_args("--model", str(run), "--steps", "1", out=again)) == 0
    first = json.loads((run / "summary.json").read_text())
    second = json.loads((again / "summary.json").read_text())
    assert second["model_source"] == str(run / "model")
    assert second["initial_val_loss"] == pytest.approx(first["val_loss"], rel=1e-5)


def test_line_progress_prints_about_twenty_lines():
    stream = io.StringIO()
    bar = make_progress(240, stream=stream)
    assert isinstance(bar, LineProgress)
    for _ in range(240):
        bar.update(1)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert 19 <= len(lines) <= 22
    assert lines[-1] == "opake train: step 240/240"
    resumed = io.StringIO()
    bar = make_progress(240, initial=100, stream=resumed)
    bar.update(1)
    assert resumed.getvalue() == ""  # a resumed run prints on the step grid, not at once


class _ZeroWidthTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True

    def fileno(self) -> int:
        return 2


def test_bar_on_a_terminal_reporting_zero_columns_is_visible(monkeypatch):
    monkeypatch.setattr(os, "get_terminal_size", lambda fd=0: os.terminal_size((0, 0)))
    monkeypatch.delenv("COLUMNS", raising=False)
    stream = _ZeroWidthTerminal()
    bar = make_progress(10, stream=stream)
    bar.set_postfix_str("loss 1.234")
    bar.update(5)
    bar.close()
    assert "5/10" in stream.getvalue()
    assert "loss 1.234" in stream.getvalue()
