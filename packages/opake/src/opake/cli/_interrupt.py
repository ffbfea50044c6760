"""Ctrl-C at a step boundary: the first SIGINT lets the current DP step finish, the second aborts.

A DP step changes several things that must stay consistent for ``--resume``: the sampler's
position, the noise counter, the optimizer, the model and the accountant. An interrupt landing
in the middle would leave a state that no checkpoint may record (a batch drawn but not trained,
noise drawn but not accounted, ...). :class:`StepBoundary` defers the first SIGINT to the next
step boundary, where the run saves a checkpoint and stops; a second SIGINT raises at once (the
last checkpoint written stands).

>>> with StepBoundary(enabled=False) as boundary:
...     boundary.check()  # nothing requested: returns
>>> boundary.requested
False
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

__all__ = ["StepBoundary", "discard_unstarted", "interrupted_before_training"]


class StepBoundary:
    """Context manager that turns the first SIGINT into a request checked at step boundaries.

    Args:
        enabled: install the handler (only possible in the main thread; under ``torchrun`` the
            ranks would stop at different steps, so the caller disables it there).
    """

    def __init__(self, *, enabled: bool = True) -> None:
        self._enabled = enabled and threading.current_thread() is threading.main_thread()
        self._previous: Any = None
        self.requested = False

    def __enter__(self) -> StepBoundary:
        if self._enabled:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._enabled:
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(
            "\nopake train: Ctrl-C — finishing the current step, then saving a checkpoint "
            "(press Ctrl-C again to stop at once, without saving)",
            file=sys.stderr,
            flush=True,
        )

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` if an interrupt was requested (call between steps)."""
        if self.requested:
            raise KeyboardInterrupt


def discard_unstarted(out: Path, *, created: bool, written: Iterable[str]) -> str:
    """Undo what a run wrote into *out* before its first step (the files named *written*), and
    remove *out* itself when the run *created* it and it is now empty; say what is left.

    >>> import tempfile
    >>> out = Path(tempfile.mkdtemp()) / "run"
    >>> out.mkdir(); _ = (out / "settings.json").write_text("{}")
    >>> discard_unstarted(out, created=True, written=["settings.json"]).endswith("removed")
    True
    >>> out.exists()
    False
    """
    for name in written:
        (out / name).unlink(missing_ok=True)
    if not out.is_dir():
        return f"{out} was not created"
    if created and not any(out.iterdir()):
        out.rmdir()
        return f"{out}, created for this run, was removed"
    return f"{out} holds what it held before the run"


def interrupted_before_training(
    out: Path, *, resume: bool, created: bool, written: Iterable[str]
) -> None:
    """Ctrl-C before the first step: say so, and leave no trace of a new run in *out* (the
    files named *written*; a resumed run's directory is left as it was)."""
    if resume:
        left = f"the run in {out} is unchanged (its last checkpoint stands)"
    else:
        left = discard_unstarted(out, created=created, written=written)
    print(
        f"opake train: interrupted before the first step: nothing was trained and no privacy "
        f"was spent; {left}",
        file=sys.stderr,
        flush=True,
    )
