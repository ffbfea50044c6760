"""What the microbatch tuner measured: one :class:`TuneCandidate` per size tried and the
:class:`TuneResult` (the choice, a table, a JSON-ready dict and a plot of the sweep)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opake.profiling._errors import ConfigurationError, OperationError

__all__ = ["FITS", "OOM", "OVER_BUDGET", "UNSTABLE", "TuneCandidate", "TuneResult"]


FITS = "fits"
OOM = "oom"
OVER_BUDGET = "over budget"
UNSTABLE = "unstable"


@dataclass(frozen=True)
class TuneCandidate:
    """What one microbatch size measured.

    Attributes:
        microbatch_size: the size tried.
        status: ``"fits"``, ``"oom"`` (out of memory on its first step), ``"over budget"`` (its
            first step peaked above the budget) or ``"unstable"`` (the first step fitted, a later
            smoke step ran out of memory or went over the budget).
        steps: steps completed (warm-up included).
        step_time_sec: median step time of the smoke steps (warm-up excluded; None if none ran).
        samples_per_second: ``batch_size / step_time_sec`` (None if no smoke step ran).
        memory_peak_gb: highest step peak seen (None if no step completed or not measurable).
        detail: why it failed, in words (empty when it fits).
    """

    microbatch_size: int
    status: str
    steps: int
    step_time_sec: float | None
    samples_per_second: float | None
    memory_peak_gb: float | None
    detail: str = ""

    @property
    def fits(self) -> bool:
        """True when every step ran within memory."""
        return self.status == FITS


@dataclass(frozen=True)
class TuneResult:
    """The tuner's answer: ``microbatch_size`` and what every candidate measured.

    Attributes:
        microbatch_size: the largest candidate that fitted (None only inside the
            :class:`NoMicrobatchFitsError` raised when none did).
        batch_size: the batch every candidate processed.
        device: the device measured.
        memory_budget_gb: the budget on the step peak (None: only real OOM limits the choice).
        candidates: every candidate tried, largest first.
        memory_process_level: peaks are process-level resident set sizes (CPU).
        memory_peak_exact: peaks are true high-water marks (not maxima of samples).
    """

    microbatch_size: int | None
    batch_size: int
    device: str
    memory_budget_gb: float | None
    candidates: tuple[TuneCandidate, ...]
    memory_process_level: bool = False
    memory_peak_exact: bool = True

    def candidate(self, microbatch_size: int) -> TuneCandidate:
        """The measurement of one size (``KeyError`` if it was not tried)."""
        for c in self.candidates:
            if c.microbatch_size == microbatch_size:
                return c
        raise KeyError(microbatch_size)

    def table(self) -> str:
        """The candidates as an aligned text table, with the budget and the choice below."""
        header = (
            f"{'microbatch':>10}  {'status':<11}  {'steps':>5}  {'step time':>10}  "
            f"{'samples/s':>10}  {'peak memory':>12}"
        )
        lines = [header, "-" * len(header)]
        for c in self.candidates:
            time_s = "-" if c.step_time_sec is None else f"{1000 * c.step_time_sec:.1f} ms"
            sps = "-" if c.samples_per_second is None else f"{c.samples_per_second:.1f}"
            peak = "-" if c.memory_peak_gb is None else f"{c.memory_peak_gb:.3f} GB"
            chosen = "  <- chosen" if c.microbatch_size == self.microbatch_size else ""
            lines.append(
                f"{c.microbatch_size:>10}  {c.status:<11}  {c.steps:>5}  {time_s:>10}  "
                f"{sps:>10}  {peak:>12}{chosen}"
            )
        kind = "process-level peak RSS" if self.memory_process_level else "peak allocated"
        if not self.memory_peak_exact:
            kind += ", sampled"
        budget = (
            "no budget (real out-of-memory errors only)"
            if self.memory_budget_gb is None
            else f"budget {self.memory_budget_gb:.3f} GB"
        )
        choice = (
            "nothing fits"
            if self.microbatch_size is None
            else f"microbatch_size={self.microbatch_size}"
        )
        lines.append(f"{self.device}, batch {self.batch_size}, {budget} on {kind}: {choice}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form of the result."""
        return {
            "microbatch_size": self.microbatch_size,
            "batch_size": self.batch_size,
            "device": self.device,
            "memory_budget_gb": self.memory_budget_gb,
            "memory_process_level": self.memory_process_level,
            "memory_peak_exact": self.memory_peak_exact,
            "candidates": [
                {
                    "microbatch_size": c.microbatch_size,
                    "status": c.status,
                    "steps": c.steps,
                    "step_time_sec": c.step_time_sec,
                    "samples_per_second": c.samples_per_second,
                    "memory_peak_gb": c.memory_peak_gb,
                    "detail": c.detail,
                }
                for c in self.candidates
            ],
        }

    def plot(self, path: str | Path) -> Path:
        """Write a PNG: peak memory and throughput against microbatch size. Returns the path.

        Needs matplotlib (``pip install 'opake-profiling[plot]'``).
        """
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            raise OperationError(
                "TuneResult.plot needs matplotlib, which is not installed; install it with "
                "`pip install 'opake-profiling[plot]'` or leave out the plot"
            ) from None
        out = Path(path)
        if out.suffix.lower() != ".png":
            raise ConfigurationError(f"plot path {str(path)!r}: expected a file name ending .png")
        fig = Figure(figsize=(9.0, 3.6), layout="constrained")
        FigureCanvasAgg(fig)
        self._draw(fig)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png", dpi=100)
        return out

    def _draw(self, fig: Any) -> None:
        """Draw the memory and throughput panels into the matplotlib figure *fig*."""
        ax_mem, ax_tp = fig.subplots(1, 2)
        ordered = sorted(self.candidates, key=lambda c: c.microbatch_size)
        measured = [c for c in ordered if c.memory_peak_gb is not None]
        ax_mem.plot(
            [c.microbatch_size for c in measured],
            [c.memory_peak_gb for c in measured],
            marker="o",
            label="step peak",
        )
        failed = [c for c in ordered if c.status in (OOM, OVER_BUDGET, UNSTABLE)]
        budget = self.memory_budget_gb
        highest = max((c.memory_peak_gb or 0.0 for c in ordered), default=0.0)
        # a budget far above every peak (a CPU default: most of free memory) would squash the
        # curve into a line at the bottom: say it in words instead of drawing it
        budget_in_view = budget is not None and (highest <= 0 or budget <= 2.0 * highest)
        if budget is not None and budget_in_view:
            ax_mem.axhline(budget, color="tab:red", linestyle="--", label="budget")
        elif budget is not None:
            ax_mem.annotate(
                f"budget {budget:.3g} GB (off scale)",
                xy=(0.02, 0.97),
                xycoords="axes fraction",
                va="top",
                color="tab:red",
            )
        if failed:
            top = max(highest, budget or 0.0) if budget_in_view else highest
            ax_mem.scatter(
                [c.microbatch_size for c in failed],
                [c.memory_peak_gb if c.memory_peak_gb is not None else top for c in failed],
                marker="x",
                color="tab:red",
                zorder=3,
                label="does not fit",
            )
        ax_mem.set_xscale("log", base=2)
        ax_mem.set_xlabel("microbatch size")
        unit = "GB, process RSS" if self.memory_process_level else "GB"
        ax_mem.set_ylabel(f"peak memory ({unit})")
        ax_mem.legend(loc="best")
        timed = [c for c in ordered if c.samples_per_second is not None]
        ax_tp.plot(
            [c.microbatch_size for c in timed],
            [c.samples_per_second for c in timed],
            marker="o",
            color="tab:green",
        )
        ax_tp.set_xscale("log", base=2)
        ax_tp.set_xlabel("microbatch size")
        ax_tp.set_ylabel("samples / second")
        fig.suptitle(
            f"{self.device}, batch {self.batch_size}: chosen microbatch {self.microbatch_size}"
        )
