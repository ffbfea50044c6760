"""``step_perf`` (time and memory of one training step, with named sub-steps) and ``PerfState``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from opake.profiling._devices import _Backend, _gb, resolve_device
from opake.profiling._errors import ConfigurationError, InputTypeError, OperationError
from opake.profiling._memory import _OPEN_WINDOWS, _backend, _reset_window

__all__ = ["MarkPerf", "PerfState", "StepPerf", "StepPerfContext", "step_perf"]


def _check_batch_size(batch_size: Any) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise InputTypeError(
            f"batch_size={batch_size!r} ({type(batch_size).__name__}): expected an int, the "
            "number of examples in the step (0 when unknown)"
        )
    if batch_size < 0:
        raise ConfigurationError(
            f"batch_size={batch_size}: expected 0 (unknown) or a positive number of examples"
        )
    return batch_size


def _max(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


@dataclass(frozen=True)
class MarkPerf:
    """One named sub-step recorded by :meth:`StepPerfContext.mark`.

    Attributes:
        name: the label given to ``mark``.
        time_sec: time since the previous mark (or since the step began).
        elapsed_sec: time since the step began.
        memory_peak_gb: peak memory during this sub-step (None when not measured).
        memory_allocated_gb: memory allocated at the mark (None when not measured).
    """

    name: str
    time_sec: float
    elapsed_sec: float
    memory_peak_gb: float | None
    memory_allocated_gb: float | None


@dataclass(frozen=True)
class StepPerf:
    """Time and memory of one step measured by :func:`step_perf`.

    Memory figures are GiB; ``None`` when ``track_memory=False`` or the device's backend is missing.
    On CPU they are process-level (resident set size), see :class:`MemoryStats`.

    Attributes:
        device: the device measured.
        batch_size: examples in the step (0 when not given).
        step_time_sec: wall time of the step, the device synchronised at entry and exit.
        memory_peak_gb: peak memory during the step (reset at entry).
        memory_allocated_gb: memory allocated at exit.
        memory_reserved_gb: memory reserved at exit.
        marks: the sub-steps, in the order they were marked.
        memory_peak_exact: the peak is a true high-water mark (not a maximum of samples).
        memory_process_level: memory figures describe the whole process (CPU).
    """

    device: str
    batch_size: int
    step_time_sec: float
    memory_peak_gb: float | None = None
    memory_allocated_gb: float | None = None
    memory_reserved_gb: float | None = None
    marks: tuple[MarkPerf, ...] = ()
    memory_peak_exact: bool = False
    memory_process_level: bool = False

    @property
    def samples_per_second(self) -> float:
        """``batch_size / step_time_sec`` (0.0 when no batch size was given)."""
        if self.batch_size == 0 or self.step_time_sec <= 0:
            return 0.0
        return self.batch_size / self.step_time_sec

    def mark_times(self) -> dict[str, float]:
        """Seconds per mark name, summed over repeated names, in first-marked order."""
        out: dict[str, float] = {}
        for m in self.marks:
            out[m.name] = out.get(m.name, 0.0) + m.time_sec
        return out

    def to_dict(self, prefix: str = "") -> dict[str, float]:
        """Flat ``{prefix + name: value}`` for a logger; unmeasured figures are left out.

        Keys: ``step_time_sec``, ``batch_size``, ``samples_per_second`` (when a batch size was
        given), ``memory_peak_gb``, ``memory_allocated_gb``, ``memory_reserved_gb``, and per mark
        name ``marks/<name>_sec`` (summed) and ``marks/<name>_peak_gb`` (max).
        """
        out: dict[str, float] = {
            f"{prefix}step_time_sec": self.step_time_sec,
            f"{prefix}batch_size": float(self.batch_size),
        }
        if self.batch_size:
            out[f"{prefix}samples_per_second"] = self.samples_per_second
        for key, value in (
            ("memory_peak_gb", self.memory_peak_gb),
            ("memory_allocated_gb", self.memory_allocated_gb),
            ("memory_reserved_gb", self.memory_reserved_gb),
        ):
            if value is not None:
                out[f"{prefix}{key}"] = value
        for name, seconds in self.mark_times().items():
            out[f"{prefix}marks/{name}_sec"] = seconds
        for m in self.marks:
            if m.memory_peak_gb is not None:
                key = f"{prefix}marks/{m.name}_peak_gb"
                out[key] = max(out.get(key, 0.0), m.memory_peak_gb)
        return out


class StepPerfContext:
    """The context manager :func:`step_perf` returns (single use)."""

    def __init__(self, device: Any, *, batch_size: int = 0, track_memory: bool = True) -> None:
        self._device = resolve_device(device)
        self._batch_size = _check_batch_size(batch_size)
        if not isinstance(track_memory, bool):
            raise InputTypeError(f"track_memory={track_memory!r}: expected True or False")
        self._track = track_memory
        self._backend: _Backend = _backend(self._device)
        self._state = "new"  # new -> open -> done
        self._result: StepPerf | None = None
        self._marks: list[MarkPerf] = []
        self._step_peak: int | None = None
        self._segment_peak: int | None = None
        self._t0 = 0.0
        self._t_last = 0.0

    # -- window protocol used by _memory._reset_window ----------------------------------------
    def fold_peak(self, value: int) -> None:
        """Keep a peak observed by a nested reset (called by :func:`reset_peak_memory`)."""
        self._segment_peak = _max(self._segment_peak, value)

    def _close_segment(self, peak_now: int | None) -> int | None:
        seen = _max(self._segment_peak, peak_now)
        self._step_peak = _max(self._step_peak, seen)
        return seen

    # -- context manager ----------------------------------------------------------------------
    def __enter__(self) -> StepPerfContext:
        if self._state != "new":
            raise OperationError(
                "this step_perf context was already used; open a new one per step "
                "(`with step_perf(device) as perf:` inside the loop)"
            )
        self._state = "open"
        self._backend.synchronize()
        if self._track:
            _reset_window(self._backend)
            _OPEN_WINDOWS.setdefault(self._backend.key, []).append(self)
        self._t0 = self._t_last = time.perf_counter()
        return self

    def mark(self, name: str) -> None:
        """Record the sub-step that ends now as ``name`` (synchronises the device first)."""
        if self._state != "open":
            raise OperationError(
                f"perf.mark({name!r}) called outside its `with step_perf(...)` block"
            )
        if not isinstance(name, str) or not name:
            raise InputTypeError(f"mark name {name!r}: expected a non-empty string")
        self._backend.synchronize()
        now = time.perf_counter()
        peak: int | None = None
        allocated: int | None = None
        if self._track:
            allocated, _, peak_now = self._backend.snapshot()
            peak = self._close_segment(peak_now)
            _reset_window(self._backend, seen=peak_now)
            self._segment_peak = None
        self._marks.append(
            MarkPerf(
                name=name,
                time_sec=now - self._t_last,
                elapsed_sec=now - self._t0,
                memory_peak_gb=_gb(peak),
                memory_allocated_gb=_gb(allocated),
            )
        )
        self._t_last = time.perf_counter()  # do not bill the mark's own bookkeeping to the next

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc_type is not None:
                return
            self._backend.synchronize()
            end = time.perf_counter()
            allocated = reserved = None
            if self._track:
                allocated, reserved, peak_now = self._backend.snapshot()
                self._close_segment(peak_now)
            self._result = StepPerf(
                device=self._backend.key,
                batch_size=self._batch_size,
                step_time_sec=end - self._t0,
                memory_peak_gb=_gb(self._step_peak),
                memory_allocated_gb=_gb(allocated),
                memory_reserved_gb=_gb(reserved),
                marks=tuple(self._marks),
                memory_peak_exact=self._track and self._backend.peak_exact,
                memory_process_level=self._backend.process_level,
            )
        finally:
            self._state = "done"
            if self._track:
                windows = _OPEN_WINDOWS.get(self._backend.key, [])
                for i, window in enumerate(windows):
                    if window is self:
                        del windows[i]
                        break

    @property
    def result(self) -> StepPerf:
        """The :class:`StepPerf` of the step, available once the ``with`` block has exited."""
        if self._result is None:
            where = "inside the block" if self._state == "open" else "for a step that raised"
            raise OperationError(
                f"perf.result read {where}; read it after the `with step_perf(...)` block "
                "completes normally"
            )
        return self._result


def step_perf(device: Any, *, batch_size: int = 0, track_memory: bool = True) -> StepPerfContext:
    """Measure one step: wall time (device synchronised), peak/allocated/reserved memory, sub-steps.

    ``perf.mark(name)`` ends a named sub-step: it synchronises the device, then records the time
    since the previous mark and, where measurable, that sub-step's peak memory. The peak is scoped
    to the step (reset at entry); on CPU it is the process's peak resident set size (see
    :class:`MemoryStats`). Works on every device; a missing backend gives ``None`` memory figures.

    Args:
        device: ``torch.device`` or string (``"cpu"``, ``"cuda:0"``, ``"mps"``).
        batch_size: examples in the step, for ``samples_per_second`` (0 when unknown).
        track_memory: measure memory (False: time only).

    Raises:
        InputTypeError: ``device`` is not a device torch understands, or an argument has the wrong
            type.

    Example:
        >>> import torch
        >>> from opake.profiling import step_perf
        >>> with step_perf("cpu", batch_size=4) as perf:
        ...     x = torch.ones(4, 8) @ torch.ones(8, 8)
        ...     perf.mark("matmul")
        >>> r = perf.result
        >>> [m.name for m in r.marks], r.step_time_sec > 0, r.memory_peak_gb > 0
        (['matmul'], True, True)
    """
    return StepPerfContext(device, batch_size=batch_size, track_memory=track_memory)


def _device_type(device: str) -> str:
    return device.split(":", 1)[0]


@dataclass(frozen=True, kw_only=True)
class PerfState:
    """Running statistics over steps; immutable: :meth:`add` returns a new state.

    Averages "excluding first" leave out the first (warm-up) step.

    Example:
        >>> from opake.profiling import PerfState, StepPerf
        >>> state = PerfState(device="cpu")
        >>> for t in (0.5, 0.1, 0.1):
        ...     state = state.add(StepPerf(device="cpu", batch_size=10, step_time_sec=t))
        >>> state.steps, state.total_samples, round(state.average_step_time_sec_excl_first, 3)
        (3, 30, 0.1)
        >>> round(state.to_dict(prefix="train/")["train/samples_per_second_excl_first"], 6)
        100.0
    """

    device: str
    steps: int = 0
    total_time_sec: float = 0.0
    total_samples: int = 0
    first_step_time_sec: float | None = None
    first_step_samples: int = 0
    max_memory_peak_gb: float | None = None
    last: StepPerf | None = field(default=None, repr=False)
    mark_totals: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", str(resolve_device(self.device)))

    def add(self, result: StepPerf) -> PerfState:
        """A new state that also counts ``result`` (this one is unchanged)."""
        if not isinstance(result, StepPerf):
            raise InputTypeError(
                f"PerfState.add({type(result).__name__}): expected the StepPerf from "
                "`perf.result` of a `with step_perf(...) as perf:` block"
            )
        if _device_type(result.device) != _device_type(self.device):
            raise ConfigurationError(
                f"PerfState for device {self.device!r} was given a step measured on "
                f"{result.device!r}; keep one PerfState per device"
            )
        totals = dict(self.mark_totals)
        for name, seconds in result.mark_times().items():
            totals[name] = totals.get(name, 0.0) + seconds
        peak = self.max_memory_peak_gb
        if result.memory_peak_gb is not None:
            peak = result.memory_peak_gb if peak is None else max(peak, result.memory_peak_gb)
        first = self.steps == 0
        return PerfState(
            device=self.device,
            steps=self.steps + 1,
            total_time_sec=self.total_time_sec + result.step_time_sec,
            total_samples=self.total_samples + result.batch_size,
            first_step_time_sec=result.step_time_sec if first else self.first_step_time_sec,
            first_step_samples=result.batch_size if first else self.first_step_samples,
            max_memory_peak_gb=peak,
            last=result,
            mark_totals=tuple(totals.items()),
        )

    @property
    def average_step_time_sec(self) -> float | None:
        """Mean step time over all steps (None before the first step)."""
        return self.total_time_sec / self.steps if self.steps else None

    @property
    def average_samples_per_second(self) -> float | None:
        """Total samples / total time (None before the first step or without batch sizes)."""
        if not self.steps or not self.total_samples or self.total_time_sec <= 0:
            return None
        return self.total_samples / self.total_time_sec

    @property
    def average_step_time_sec_excl_first(self) -> float | None:
        """Mean step time without the first (warm-up) step (None with fewer than 2 steps)."""
        if self.steps < 2 or self.first_step_time_sec is None:
            return None
        return (self.total_time_sec - self.first_step_time_sec) / (self.steps - 1)

    @property
    def average_samples_per_second_excl_first(self) -> float | None:
        """Samples per second without the first (warm-up) step (None with fewer than 2 steps)."""
        if self.steps < 2 or self.first_step_time_sec is None:
            return None
        samples = self.total_samples - self.first_step_samples
        seconds = self.total_time_sec - self.first_step_time_sec
        return samples / seconds if samples and seconds > 0 else None

    @property
    def mark_totals_sec(self) -> dict[str, float]:
        """Total seconds per mark name over all steps."""
        return dict(self.mark_totals)

    def to_dict(self, prefix: str = "") -> dict[str, float]:
        """Flat ``{prefix + name: value}`` for a logger; figures not yet defined are left out.

        Keys: ``steps``, ``samples``, ``time_sec`` (totals), ``step_time_sec`` and
        ``samples_per_second`` (averages), the same with ``_excl_first``,
        ``memory_peak_gb_max``, and per mark name ``marks/<name>_sec`` (mean seconds per step).
        """
        out: dict[str, float] = {
            f"{prefix}steps": float(self.steps),
            f"{prefix}samples": float(self.total_samples),
            f"{prefix}time_sec": self.total_time_sec,
        }
        for key, value in (
            ("step_time_sec", self.average_step_time_sec),
            ("samples_per_second", self.average_samples_per_second),
            ("step_time_sec_excl_first", self.average_step_time_sec_excl_first),
            ("samples_per_second_excl_first", self.average_samples_per_second_excl_first),
            ("memory_peak_gb_max", self.max_memory_peak_gb),
        ):
            if value is not None:
                out[f"{prefix}{key}"] = value
        if self.steps:
            for name, seconds in self.mark_totals:
                out[f"{prefix}marks/{name}_sec"] = seconds / self.steps
        return out
