"""The microbatch auto-tuner: the seed's manual sweep done for the user.

Start at the batch size, halve until the step fits (a real out-of-memory error on CUDA/MPS, a
memory budget on the measured peak), smoke-run a few steps, keep the largest stable size. The
choice is privacy-neutral: the microbatch size only changes how the per-example gradients of one
batch are chunked, never which examples are clipped or how (tested against ``clipped_grad``).
"""

from __future__ import annotations

import gc
import logging
import math
import statistics
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from opake.profiling._devices import resolve_device
from opake.profiling._errors import (
    ConfigurationError,
    InputTypeError,
    NoMicrobatchFitsError,
)
from opake.profiling._memory import _backend
from opake.profiling._step import step_perf
from opake.profiling._tune_result import (
    FITS,
    OOM,
    OVER_BUDGET,
    UNSTABLE,
    TuneCandidate,
    TuneResult,
)

__all__ = ["TuneCandidate", "TuneResult", "default_candidates", "tune_microbatch"]

_log = logging.getLogger("opake.profiling")

# Fraction of the free memory the CPU default budget may use on top of the current RSS.
CPU_DEFAULT_FREE_FRACTION = 0.8


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
    _check_step_arguments(make_grad_fn, args, kwargs)
    batch_size = _check_int("batch_size", batch_size, 1)
    steps = _check_int("steps", steps, 1)
    warmup_steps = _check_int("warmup_steps", warmup_steps, 1)
    compare_smaller = _check_int("compare_smaller", compare_smaller, 0)
    dev = resolve_device(device)
    backend = _backend(dev)
    sizes = _candidate_sizes(candidates, batch_size)
    budget = _budget(memory_budget_gb, dev, process_level=backend.process_level)

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
    _report(result)
    return result


def _report(result: TuneResult) -> None:
    """Log the choice (and the sizes that did not fit); raise when none fits."""
    for cand in result.candidates:
        if not cand.fits:
            _log.info(
                "tune_microbatch: microbatch %d on %s does not fit (%s: %s)",
                cand.microbatch_size,
                result.device,
                cand.status,
                cand.detail,
            )
    if result.microbatch_size is None:
        smallest = result.candidates[-1]
        raise NoMicrobatchFitsError(
            f"no microbatch size fits on {result.device}: even {smallest.microbatch_size} gave "
            f"{smallest.status} ({smallest.detail}); raise the budget, shorten the sequences, or "
            "train fewer parameters (LoRA)",
            result,
        )
    _log.info(
        "tune_microbatch: chose microbatch %d of batch %d on %s",
        result.microbatch_size,
        result.batch_size,
        result.device,
    )


def _check_step_arguments(make_grad_fn: Any, args: Any, kwargs: Any) -> None:
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


def _candidate_sizes(candidates: Sequence[int] | None, batch_size: int) -> tuple[int, ...]:
    """The sizes to try, largest first (default: ``batch_size`` halved down to 1)."""
    if candidates is None:
        return default_candidates(batch_size)
    if isinstance(candidates, (str, bytes)) or not isinstance(candidates, Sequence):
        raise InputTypeError(f"candidates={candidates!r}: expected a sequence of microbatch sizes")
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
    return sizes


def _budget(memory_budget_gb: Any, dev: Any, *, process_level: bool) -> float | None:
    """The peak limit in GiB: the given one, the CPU default (process-level peaks), or None."""
    if memory_budget_gb is not None:
        if isinstance(memory_budget_gb, bool) or not isinstance(memory_budget_gb, (int, float)):
            raise InputTypeError(
                f"memory_budget_gb={memory_budget_gb!r}: expected a number of GiB or None"
            )
        if not math.isfinite(memory_budget_gb) or memory_budget_gb <= 0:
            raise ConfigurationError(
                f"memory_budget_gb={memory_budget_gb}: expected a positive, finite number of GiB"
            )
        return float(memory_budget_gb)
    if not process_level:
        return None
    budget = _cpu_default_budget(dev)
    _log.info(
        "tune_microbatch: no memory_budget_gb on %s (process-level peaks): using the current "
        "RSS plus %.0f%% of the free memory, %.3f GiB",
        dev,
        100 * CPU_DEFAULT_FREE_FRACTION,
        budget,
    )
    return budget


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
