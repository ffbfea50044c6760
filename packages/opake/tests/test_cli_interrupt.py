"""Ctrl-C and ``--resume``: a real SIGINT to an ``opake train`` process, at several points.

The guarantee (``docs/guide/train.md``): with ``--reproducible``, a run interrupted with Ctrl-C
(any number of times, at any step) and continued with ``--resume`` ends with the same model,
the same metrics and the same ε as the uninterrupted run, bit for bit.
"""

from __future__ import annotations

import csv
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opake.cli import main

STEPS = 24
STEP_LINE = re.compile(r"opake train.*: step (\d+)/(\d+)")


def _argv(tiny_args, out: Path, *extra: str) -> list[str]:
    argv = tiny_args(
        "--steps", str(STEPS), "--reproducible", "--eval-every", "8", "--no-plots", *extra, out=out
    )
    argv.remove("--no-progress")  # the progress lines tell the test where the run is
    return argv


def _interrupt_after(argv: list[str], step: int) -> tuple[int, str]:
    """Run ``opake`` in a subprocess, SIGINT it once it reports ``step`` (or later)."""
    opake = Path(sys.executable).with_name("opake")
    seen = []
    sent = False
    with subprocess.Popen(
        [str(opake), *argv], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    ) as proc:
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            match = STEP_LINE.search(line)
            if not sent and match and int(match.group(1)) >= step:
                proc.send_signal(signal.SIGINT)
                sent = True
        proc.wait(timeout=300)
    return proc.returncode, "".join(seen)


def _rows(directory: Path) -> list[dict[str, str]]:
    with (directory / "metrics.csv").open() as handle:
        return list(csv.DictReader(handle))


@pytest.mark.timeout(400)
def test_sigint_then_resume_equals_the_uninterrupted_run(tiny_args, tmp_path):
    full, parts = tmp_path / "full", tmp_path / "parts"
    assert main([*_argv(tiny_args, full), "--no-progress"]) == 0

    stops = []
    for target in (4, 12):  # two interruptions, the second one of a resumed run
        extra = ("--resume",) if stops else ()
        code, err = _interrupt_after(_argv(tiny_args, parts, *extra), target)
        assert code == 130, err[-3000:]
        found = re.search(r"interrupted after step (\d+)", err)
        assert found, err[-3000:]
        assert "Traceback" not in err
        stopped = int(found.group(1))
        assert stopped >= target
        assert stopped < STEPS
        stops.append(stopped)
    assert stops[1] > stops[0]
    assert main([*_argv(tiny_args, parts, "--resume"), "--no-progress"]) == 0

    a = json.loads((full / "summary.json").read_text())
    b = json.loads((parts / "summary.json").read_text())
    assert b["resumed_from_step"] == stops[1]
    for key in ("epsilon", "val_loss", "train_loss", "steps", "randomness"):
        assert a[key] == b[key], key
    from safetensors.torch import load_file

    wa = load_file(str(full / "model" / "model.safetensors"))
    wb = load_file(str(parts / "model" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    ra, rb = _rows(full), _rows(parts)
    for key in ("step", "train_loss", "val_loss", "epsilon", "batch_size", "clipping_rate", "lr"):
        assert [r[key] for r in ra] == [r[key] for r in rb], key


def test_first_sigint_is_deferred_to_the_step_boundary_the_second_stops_at_once(capsys):
    import os

    from opake.cli._interrupt import StepBoundary

    before = signal.getsignal(signal.SIGINT)
    with StepBoundary() as boundary:
        os.kill(os.getpid(), signal.SIGINT)  # mid-step: only recorded
        assert boundary.requested
        assert "finishing the current step" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C: at once
        with pytest.raises(KeyboardInterrupt):
            boundary.check()  # at the boundary: stop
    assert signal.getsignal(signal.SIGINT) is before


def _raise_interrupt(*args: object, **kwargs: object) -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["_build_model", "_evaluate", "_lr_at"])
def test_ctrl_c_before_the_first_step_says_so_and_leaves_no_directory(
    tiny_args, tmp_path, monkeypatch, capsys, where
):
    # Ctrl-C while the model is built, while the start is evaluated, or at the first step
    # boundary (issue 29, item 6): exit 130 with a message, and no --out left behind
    monkeypatch.setattr(f"opake.cli._trainer.{where}", _raise_interrupt)
    out = tmp_path / "new" / "run"
    assert main(tiny_args(out=out)) == 130
    err = capsys.readouterr().err
    said = "opake train: interrupted before the first step: nothing was trained and no privacy "
    assert said + "was spent" in err
    assert "Traceback" not in err
    assert not out.exists()


def test_ctrl_c_before_the_first_step_keeps_a_directory_the_user_made(
    tiny_args, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file")
    monkeypatch.setattr("opake.cli._trainer._lr_at", _raise_interrupt)
    assert main(tiny_args(out=out)) == 130
    assert f"{out} holds what it held before the run" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_a_resumed_run_says_where_it_continues_and_what_was_spent(
    tiny_args, tmp_path, monkeypatch, capsys
):
    from opake.cli import _trainer

    out = tmp_path / "run"
    real = _trainer._lr_at

    def stop_at_two(step: int, **kwargs: object) -> float:
        if step == 2:
            raise KeyboardInterrupt
        return real(step, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_trainer, "_lr_at", stop_at_two)
    assert main(tiny_args(out=out)) == 130
    assert "interrupted after step 2" in capsys.readouterr().err
    monkeypatch.undo()
    assert main(tiny_args("--resume", out=out)) == 0
    err = capsys.readouterr().err
    found = re.search(r"resume    after step 2 of 4: ε = ([0-9.]+) spent so far at δ = ", err)
    assert found, err
    rows = _rows(out)
    assert rows[1]["step"] == "2"
    assert float(found.group(1)) == pytest.approx(float(rows[1]["epsilon"]), abs=1e-3)
