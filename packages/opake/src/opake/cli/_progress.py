"""Progress of a training run on standard error: a bar on a terminal, plain lines elsewhere.

On a terminal :func:`make_progress` returns a ``tqdm`` bar (its width follows the terminal; a
terminal that reports no width gets a fixed one instead of an invisible bar). When standard error
is a file or a pipe (a log, CI), a bar would write hundreds of carriage-return updates into it:
:class:`LineProgress` prints one complete line every few steps instead.

>>> import io
>>> stream = io.StringIO()
>>> bar = make_progress(4, stream=stream, every=2)
>>> for step in range(4):
...     bar.set_postfix_str(f"loss {1.0 / (step + 1):.2f}")
...     bar.update(1)
>>> bar.close()
>>> print(stream.getvalue(), end="")
opake train: step 1/4  loss 1.00
opake train: step 2/4  loss 0.50
opake train: step 4/4  loss 0.25
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Protocol, TextIO

__all__ = ["LineProgress", "Progress", "make_progress"]

#: lines printed over a whole run when standard error is not a terminal (about)
LINES_PER_RUN = 20
#: bar width when the terminal reports fewer columns than this (0 in some containers)
_MIN_COLUMNS = 20
_FALLBACK_COLUMNS = 100


class Progress(Protocol):
    """What the training loop calls: the subset of ``tqdm`` it uses."""

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...

    def update(self, n: int = 1) -> object: ...

    def close(self) -> None: ...


class LineProgress:
    """One line per *every* steps (and the first and last step), no carriage returns."""

    def __init__(
        self, total: int, *, initial: int = 0, desc: str, stream: TextIO, every: int
    ) -> None:
        self.total, self.n, self.desc, self.stream = total, initial, desc, stream
        self.every = max(1, every)
        self.postfix = ""

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """Remember the figures shown on the next line."""
        self.postfix = s

    def update(self, n: int = 1) -> None:
        """Advance by *n* steps; print a line on the first step, every *every*, and the last."""
        before, self.n = self.n, self.n + n
        crossed = self.n // self.every > before // self.every
        if before == 0 or crossed or self.n >= self.total:
            self._line()

    def _line(self) -> None:
        text = f"{self.desc}: step {self.n}/{self.total}"
        if self.postfix:
            text += f"  {self.postfix}"
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Nothing left to draw (the last step printed its line)."""


def _columns(stream: TextIO) -> int | None:
    """The terminal width of *stream*, or ``None`` when it is not a terminal."""
    try:
        if not stream.isatty():
            return None
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return None


def make_progress(
    total: int,
    *,
    initial: int = 0,
    desc: str = "opake train",
    enabled: bool = True,
    stream: TextIO | None = None,
    every: int | None = None,
) -> Progress:
    """The progress display of a run of *total* steps starting after step *initial*.

    A ``tqdm`` bar when *stream* (default standard error) is a terminal, else a
    :class:`LineProgress` printing about :data:`LINES_PER_RUN` lines (or one every *every*
    steps). Disabled: a bar that prints nothing.
    """
    from tqdm.auto import tqdm

    out = stream if stream is not None else sys.stderr
    if not enabled:
        silent: Progress = tqdm(total=total, initial=initial, disable=True)  # tqdm is untyped
        return silent
    columns = _columns(out)
    if columns is None:
        step = every if every is not None else math.ceil(total / LINES_PER_RUN)
        return LineProgress(total, initial=initial, desc=desc, stream=out, every=step)
    wide_enough = columns >= _MIN_COLUMNS
    if not wide_enough:
        env = os.environ.get("COLUMNS", "")
        columns = int(env) if env.isdigit() and int(env) >= _MIN_COLUMNS else _FALLBACK_COLUMNS
    bar: Progress = tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit="step",
        file=out,
        dynamic_ncols=wide_enough,
        ncols=None if wide_enough else columns,
    )
    return bar


def step_postfix(row: dict[str, Any], peak_seen: float | None) -> str:
    """The progress bar's postfix after a step: loss, ε, throughput, peak memory."""
    from opake.cli._summary import _fmt_gb

    rate = row["samples_per_second"] or 0.0
    return (
        f"loss {row['train_loss']:.3f}  ε {row['epsilon']:.2f}  {rate:.0f} samples/s  "
        f"peak {_fmt_gb(peak_seen)}"
    )
