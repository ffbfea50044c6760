"""The markdown report of the GPU checks that run steps within a time budget.

``kernels_check.py`` and ``profiling_check.py`` record each step (ok/FAILED, its text, its time)
in a :class:`Report` as soon as it ends, and skip a step the budget no longer covers. In a bare
checkout (nothing pip-installed) they put :func:`package_sources` on ``sys.path``. The scripts
import this module as a sibling: run as ``python tools/gpu/X.py``, their folder is first on
``sys.path``.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def package_sources() -> list[str]:
    """Every distribution's ``src`` folder, ``packages/*/src``."""
    return [str(d / "src") for d in sorted((ROOT / "packages").iterdir())]


class Report:
    """Markdown report, rewritten after every step so a killed run still leaves its results.

    *start*: the script's start (``time.monotonic()``), from which the budget counts.
    """

    def __init__(self, path: Path, title: str, *, start: float) -> None:
        self.path = path
        self.start = start
        self.parts: list[str] = [f"# {title}", ""]
        self.failures = 0

    def add(self, text: str) -> None:
        self.parts.append(text)
        self.path.write_text("\n".join(self.parts) + "\n")
        print(text, flush=True)

    def step(self, title: str, fn: Callable[[], str], budget: float, needs: float) -> None:
        """Run *fn* (its markdown) unless the *needs* seconds it takes would overrun *budget*."""
        elapsed = time.monotonic() - self.start
        if elapsed + needs > budget:
            self.add(f"## {title}\n\nSKIPPED: {elapsed:.0f} s spent, step needs ~{needs:.0f} s "
                     f"of a {budget:.0f} s budget.\n")  # fmt: skip
            return
        t = time.monotonic()
        try:
            body = fn()
            status = "ok"
        except Exception:
            self.failures += 1
            body = "```\n" + traceback.format_exc()[-4000:] + "```"
            status = "FAILED"
        self.add(f"## {title} — {status} ({time.monotonic() - t:.1f} s)\n\n{body}\n")
