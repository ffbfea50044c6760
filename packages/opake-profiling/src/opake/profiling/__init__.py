"""Opake profiling (distribution ``opake-profiling``): step time and memory, on every device.

- :func:`step_perf` measures one step (time with the device synchronised, peak/allocated/reserved
  memory, named sub-steps through ``perf.mark(name)``); :class:`PerfState` accumulates steps.
- :func:`get_memory_stats`, :func:`print_memory`, :func:`reset_peak_memory`, :func:`empty_cache`:
  memory snapshots whose flags say which figures are exact and which are process-level (CPU).
- :func:`tune_microbatch`: the largest microbatch size that fits, with step time and peak memory
  per candidate (also ``opake tune``).
- :func:`measure_memory_line` fits a :class:`MemoryLine` (step peak against examples at once)
  through two probe steps; :func:`choose_microbatch` picks a microbatch from it for the
  :func:`largest_poisson_batch` within a limit, such as part of :func:`available_memory_gb`
  (``opake train``'s and ``DPTrainer``'s memory-aware default microbatch).

Memory figures are GiB (2**30 bytes). Depends on torch only; with ``opake-core`` installed the
errors are the ``opake.core.errors`` classes.

Example:
    >>> from opake.profiling import PerfState, step_perf
    >>> state = PerfState(device="cpu")
    >>> for _ in range(2):
    ...     with step_perf("cpu", batch_size=8) as perf:
    ...         perf.mark("work")
    ...     state = state.add(perf.result)
    >>> state.steps, state.to_dict(prefix="train/")["train/samples"]
    (2, 16.0)
"""

from __future__ import annotations

from opake.profiling._errors import (
    ConfigurationError,
    InputTypeError,
    NoMicrobatchFitsError,
    OpakeError,
    OperationError,
)
from opake.profiling._memory import (
    MemoryStats,
    empty_cache,
    get_memory_stats,
    print_memory,
    reset_peak_memory,
)
from opake.profiling._memory_line import (
    PROBE_EXAMPLES,
    MemoryLine,
    available_memory_gb,
    choose_microbatch,
    format_gb,
    largest_poisson_batch,
    measure_memory_line,
)
from opake.profiling._step import MarkPerf, PerfState, StepPerf, StepPerfContext, step_perf
from opake.profiling._tuner import TuneCandidate, TuneResult, default_candidates, tune_microbatch
from opake.profiling._version import __version__

__all__ = [
    "PROBE_EXAMPLES",
    "ConfigurationError",
    "InputTypeError",
    "MarkPerf",
    "MemoryLine",
    "MemoryStats",
    "NoMicrobatchFitsError",
    "OpakeError",
    "OperationError",
    "PerfState",
    "StepPerf",
    "StepPerfContext",
    "TuneCandidate",
    "TuneResult",
    "__version__",
    "available_memory_gb",
    "choose_microbatch",
    "default_candidates",
    "empty_cache",
    "format_gb",
    "get_memory_stats",
    "largest_poisson_batch",
    "measure_memory_line",
    "print_memory",
    "reset_peak_memory",
    "step_perf",
    "tune_microbatch",
]
