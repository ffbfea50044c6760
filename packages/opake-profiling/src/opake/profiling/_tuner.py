"""The microbatch auto-tuner: the seed's manual sweep done for the user.

Start at the batch size, halve until the step fits (a real out-of-memory error on CUDA/MPS, a
memory budget on the measured peak), smoke-run a few steps, keep the largest stable size. The
choice is privacy-neutral: the microbatch size only changes how the per-example gradients of one
batch are chunked, never which examples are clipped or how (tested against ``clipped_grad``).
"""

from __future__ import annotations

import gc
import math
import statistics
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opake.profiling._errors import (
    ConfigurationError,
    InputTypeError,
    NoMicrobatchFitsError,
    OperationError,
)
from opake.profiling._memory import _backend, resolve_device
from opake.profiling._step import step_perf

__all__ = ["TuneCandidate", "TuneResult", "default_candidates", "tune_microbatch"]

FITS = "fits"
OOM = "oom"
OVER_BUDGET = "over budget"
UNSTABLE = "unstable"

# Fraction of the free memory the CPU default budget may use on top of the current RSS.
CPU_DEFAULT_FREE_FRACTION = 0.8


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


def default_candidates(batch_size: int) -> tuple[int, ...]:
    """``batch_size`` halved down to 1 (floor division): ``48 -> (48, 24, 12, 6, 3, 1)``.

    Example:
        >>> from opake.profiling import default_candidates
        >>> default_candidates(48)
        (48, 24, 12, 6, 3, 1)
    """
    sizes = []
    m = batch_size
    while m >= 1:
        sizes.append(m)
        m //= 2
    return tuple(sizes)


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputTypeError(f"{name}={value!r} ({type(value).__name__}): expected an int")
    if value < minimum:
        raise ConfigurationError(f"{name}={value}: expected an int >= {minimum}")
    return value


def _is_oom(err: BaseException) -> bool:
    import torch

    if isinstance(err, torch.OutOfMemoryError):
        return True
    if isinstance(err, RuntimeError):
        text = str(err).lower()
        # MPS on older torch ("MPS backend out of memory"), the CPU allocator ("can't allocate")
        return "out of memory" in text or "can't allocate memory" in text
    return False


def _release(err: BaseException) -> str:
    """Drop the frames an exception keeps alive (their locals hold tensors); return its text."""
    text = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if current.__traceback__ is not None:
            traceback.clear_frames(current.__traceback__)
            current.__traceback__ = None
        current = current.__cause__ or current.__context__
    return text.rstrip(": ")


class _Runner:
    """Calls the step a candidate's factory built, threading an optional state through."""

    def __init__(self, built: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        self.stateful = isinstance(built, tuple)
        if self.stateful:
            if len(built) != 2 or not callable(built[0]):
                raise InputTypeError(
                    "make_grad_fn(m) returned a tuple that is not (grad_fn, state); return a "
                    "callable, or the (grad_fn, state) pair clipped_grad returns"
                )
            self.fn, self.state = built
        else:
            if not callable(built):
                raise InputTypeError(
                    f"make_grad_fn(m) returned {type(built).__name__}; expected a callable "
                    "(or a (grad_fn, state) pair)"
                )
            self.fn, self.state = built, None
        self.args = tuple(args)
        self.kwargs = dict(kwargs)

    def step(self) -> None:
        if self.stateful:
            out = self.fn(*self.args, state=self.state, **self.kwargs)
            if isinstance(out, tuple) and len(out) == 2:
                self.state = out[1]
        else:
            out = self.fn(*self.args, **self.kwargs)
        del out


def _cpu_default_budget(device: Any) -> float:
    from opake.profiling._memory import get_memory_stats

    stats = get_memory_stats(device)
    return (stats.allocated_gb or 0.0) + CPU_DEFAULT_FREE_FRACTION * (stats.free_gb or 0.0)


def tune_microbatch(
    make_grad_fn: Callable[[int], Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    batch_size: int,
    device: Any,
    memory_budget_gb: float | None = None,
    candidates: Sequence[int] | None = None,
    steps: int = 20,
    warmup_steps: int = 1,
    compare_smaller: int = 2,
    plot: str | Path | None = None,
    callback: Callable[[TuneCandidate], None] | None = None,
) -> TuneResult:
    """Find the largest microbatch size whose step fits in memory, and measure the trade-off.

    For each candidate, largest first, ``make_grad_fn(m)`` builds a step and the tuner runs
    ``warmup_steps`` steps (the first says whether it fits at all), then ``steps`` smoke steps,
    each inside :func:`step_perf`. A candidate fits when no step raised an out-of-memory error
    (``torch.OutOfMemoryError``, or the MPS/CPU allocator's out-of-memory ``RuntimeError``) and no
    step's peak exceeded ``memory_budget_gb``. After an out-of-memory error the tuner drops every
    reference the failed step held, collects garbage and empties the device cache before the next
    candidate. The first size that fits is chosen; ``compare_smaller`` smaller sizes are then
    measured too, for the table and plot (memory and throughput against microbatch size).
    Where the peak is process-level (CPU), the heap is trimmed (glibc ``malloc_trim``) before
    every step, so memory that an earlier step or candidate freed, but the allocator kept
    resident, does not count toward the step's peak.

    ``make_grad_fn(m)`` returns either a callable, run as ``fn(*args, **kwargs)``, or a
    ``(grad_fn, state)`` pair — what ``opake.dpsgd.clipping.clipped_grad(...)`` returns — run as
    ``grad_fn(*args, state=state, **kwargs)``, its ``(grads, state)`` result's state passed on.
    Errors other than out-of-memory propagate.

    Args:
        make_grad_fn: builds the step for one microbatch size.
        args: positional arguments of every step (params, batch, ...).
        kwargs: keyword arguments of every step.
        batch_size: examples in the batch (the first candidate, and the throughput numerator).
        device: where the step runs; its memory is measured.
        memory_budget_gb: limit on each step's peak (GiB). Default: none on CUDA/MPS (real
            out-of-memory errors decide); on CPU, where running out of memory kills the process
            instead of raising, the current RSS plus 80% of the free memory. On CPU the peak is the
            process's resident set size, so the budget is on the whole process.
        candidates: sizes to try (default: ``batch_size`` halved down to 1); tried largest first.
        steps: smoke steps per candidate after the warm-up (the seed suggests 20-50).
        warmup_steps: steps per candidate before timing (they are also checked against memory).
        compare_smaller: sizes below the chosen one to measure as well (0: stop at the choice).
        plot: write a PNG of the sweep there (needs matplotlib).
        callback: called with each :class:`TuneCandidate` as soon as it is measured.

    Returns:
        a :class:`TuneResult` with ``microbatch_size`` and every candidate's step time and peak.

    Raises:
        NoMicrobatchFitsError: no candidate fits (its ``.result`` has the measurements).
        ConfigurationError / InputTypeError: bad arguments.

    Example:
        >>> import torch
        >>> from opake.profiling import tune_microbatch
        >>> x = torch.randn(8, 4)
        >>> def make(m):
        ...     return lambda x: [c.sum() for c in x.split(m)]
        >>> r = tune_microbatch(make, (x,), batch_size=8, device="cpu", steps=2)
        >>> r.microbatch_size, [c.microbatch_size for c in r.candidates]
        (8, [8, 4, 2])
    """
    if not callable(make_grad_fn):
        raise InputTypeError(
            f"make_grad_fn={make_grad_fn!r}: expected a callable taking a microbatch size"
        )
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise InputTypeError(
            f"args={type(args).__name__}: expected a tuple of the step's positional arguments"
        )
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise InputTypeError(f"kwargs={type(kwargs).__name__}: expected a mapping or None")
    batch_size = _check_int("batch_size", batch_size, 1)
    steps = _check_int("steps", steps, 1)
    warmup_steps = _check_int("warmup_steps", warmup_steps, 1)
    compare_smaller = _check_int("compare_smaller", compare_smaller, 0)
    dev = resolve_device(device)
    backend = _backend(dev)
    if candidates is None:
        sizes = default_candidates(batch_size)
    else:
        if isinstance(candidates, (str, bytes)) or not isinstance(candidates, Sequence):
            raise InputTypeError(
                f"candidates={candidates!r}: expected a sequence of microbatch sizes"
            )
        for c in candidates:
            _check_int("candidate microbatch size", c, 1)
            if c > batch_size:
                raise ConfigurationError(
                    f"candidate microbatch size {c} exceeds batch_size={batch_size}; "
                    "candidates must be between 1 and the batch size"
                )
        sizes = tuple(sorted(set(candidates), reverse=True))
        if not sizes:
            raise ConfigurationError("candidates=[]: give at least one microbatch size")
    if memory_budget_gb is not None:
        if isinstance(memory_budget_gb, bool) or not isinstance(memory_budget_gb, (int, float)):
            raise InputTypeError(
                f"memory_budget_gb={memory_budget_gb!r}: expected a number of GiB or None"
            )
        if not math.isfinite(memory_budget_gb) or memory_budget_gb <= 0:
            raise ConfigurationError(
                f"memory_budget_gb={memory_budget_gb}: expected a positive, finite number of GiB"
            )
        budget: float | None = float(memory_budget_gb)
    elif backend.process_level:
        budget = _cpu_default_budget(dev)
    else:
        budget = None

    _clean(dev, full=True)
    measured: list[TuneCandidate] = []
    chosen: int | None = None
    extra = 0
    for m in sizes:
        if chosen is not None and extra >= compare_smaller:
            break
        cand = _measure(
            make_grad_fn,
            m,
            args=args,
            kwargs=kwargs or {},
            dev=dev,
            batch_size=batch_size,
            budget=budget,
            steps=steps,
            warmup_steps=warmup_steps,
        )
        measured.append(cand)
        if callback is not None:
            callback(cand)
        if chosen is None:
            if cand.fits:
                chosen = m
        else:
            extra += 1

    _clean(dev, full=True)
    result = TuneResult(
        microbatch_size=chosen,
        batch_size=batch_size,
        device=str(backend.key),
        memory_budget_gb=budget,
        candidates=tuple(measured),
        memory_process_level=backend.process_level,
        memory_peak_exact=backend.peak_exact,
    )
    if plot is not None:
        result.plot(plot)
    if chosen is None:
        smallest = measured[-1]
        raise NoMicrobatchFitsError(
            f"no microbatch size fits on {result.device}: even {smallest.microbatch_size} gave "
            f"{smallest.status} ({smallest.detail}); raise the budget, shorten the sequences, or "
            "train fewer parameters (LoRA)",
            result,
        )
    return result


def _clean(dev: Any, *, full: bool) -> None:
    """Collect garbage (``full``: every generation; else the young ones, which is what a step
    leaves behind, at a fraction of the cost) and empty the device cache."""
    if full:
        gc.collect()
    else:
        gc.collect(1)
    _backend(dev).empty_cache()


def _measure(
    make_grad_fn: Callable[[int], Any],
    m: int,
    *,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    dev: Any,
    batch_size: int,
    budget: float | None,
    steps: int,
    warmup_steps: int,
) -> TuneCandidate:
    times: list[float] = []
    peak: float | None = None
    done = 0
    status, detail = FITS, ""
    runner: _Runner | None = None
    backend = _backend(dev)
    try:
        runner = _Runner(make_grad_fn(m), args, kwargs)
        for i in range(warmup_steps + steps):
            if backend.process_level:
                # Process-level peaks (CPU RSS) count freed memory the allocator kept resident:
                # without a trim, what earlier steps freed into the heap inflates this step's
                # peak (by how much depends on where the heap places the step's tensors).
                backend.empty_cache()
            with step_perf(dev, batch_size=batch_size) as perf:
                runner.step()
            r = perf.result
            done += 1
            if r.memory_peak_gb is not None:
                peak = r.memory_peak_gb if peak is None else max(peak, r.memory_peak_gb)
            if i >= warmup_steps:
                times.append(r.step_time_sec)
            if budget is not None and r.memory_peak_gb is not None and r.memory_peak_gb > budget:
                status = OVER_BUDGET if i == 0 else UNSTABLE
                detail = f"step {i + 1} peaked at {r.memory_peak_gb:.3f} GB > {budget:.3f} GB"
                break
    except (RuntimeError, MemoryError) as err:
        if not (_is_oom(err) or isinstance(err, MemoryError)):
            raise
        status = OOM if done == 0 else UNSTABLE
        detail = f"step {done + 1}: {_release(err)}"
    finally:
        runner = None
    del runner
    _clean(dev, full=False)
    median = statistics.median(times) if times else None
    return TuneCandidate(
        microbatch_size=m,
        status=status,
        steps=done,
        step_time_sec=median,
        samples_per_second=None if not median else batch_size / median,
        memory_peak_gb=peak,
        detail=detail,
    )
