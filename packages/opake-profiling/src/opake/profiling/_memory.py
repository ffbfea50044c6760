"""Memory statistics that say how exact they are, on CUDA, MPS, other accelerators and CPU.

One small backend per device kind reads the figures (:mod:`opake.profiling._devices`; the CPU
one in :mod:`opake.profiling._cpu`); everything else (``get_memory_stats``, ``step_perf``, the
tuner) goes through :func:`_backend`, here. Figures are GiB (2**30 bytes).

- CUDA: the CUDA caching allocator (``torch.cuda``): allocated, reserved, peak are exact.
- MPS: on torch >= 2.13 the peak comes from ``torch.accelerator`` memory statistics (exact); on
  older torch it is the maximum of the current allocation *sampled* at entry, marks and exit
  (``peak_exact=False``). ``reserved`` is the Metal driver allocation.
- Another ``torch.accelerator`` device (XPU, ...): ``torch.accelerator`` memory statistics.
- CPU: process-level figures (``process_level=True``): resident set size now, and the peak RSS since
  the last reset — the kernel's ``VmHWM``, reset by writing ``5`` to ``/proc/self/clear_refs``
  (exact). Where that reset is not permitted, or on a system without ``/proc``, the peak after a
  reset is sampled (``peak_exact=False``); before any reset it is the process's lifetime peak.
- A device type whose backend is missing (``"cuda"`` on a CPU-only torch) reports
  ``available=False`` and ``None`` figures; it never raises.
"""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass
from typing import IO, Any

from opake.profiling._cpu import _Cpu
from opake.profiling._devices import (
    _Accelerator,
    _accelerator_is,
    _Backend,
    _Cuda,
    _gb,
    _Mps,
    _Unavailable,
    resolve_device,
)

__all__ = [
    "MemoryStats",
    "empty_cache",
    "get_memory_stats",
    "print_memory",
    "reset_peak_memory",
]


def _backend(device: Any) -> _Backend:
    """The backend that measures ``device`` (validated by :func:`resolve_device`)."""
    import torch

    dev = resolve_device(device)
    if dev.type == "cpu":
        return _Cpu(dev)
    if dev.type == "cuda":
        return _Cuda(dev) if torch.cuda.is_available() else _Unavailable(dev)
    if dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        available = mps is not None and mps.is_available()
        return _Mps(dev) if available else _Unavailable(dev)
    if _accelerator_is(dev.type):
        return _Accelerator(dev)
    return _Unavailable(dev)


# ---------------------------------------------------------------------------------------------
# Peak windows shared between nested measurements
# ---------------------------------------------------------------------------------------------

# Open step_perf windows per device key; a reset inside a window folds the peak seen so far into
# every open window first, so nested step_perf blocks (or a user's reset_peak_memory inside one)
# never lose an outer window's peak.
_OPEN_WINDOWS: dict[str, list[Any]] = {}


def _reset_window(backend: _Backend, *, seen: int | None = None) -> None:
    """Reset the peak; open windows first keep what they saw (``seen``: a peak just read)."""
    windows = _OPEN_WINDOWS.get(backend.key)
    if windows:
        if seen is None:
            seen = backend.peak()
        if seen is not None:
            for window in windows:
                window.fold_peak(seen)
    backend.reset_peak()


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryStats:
    """A snapshot of one device's memory, in GiB, with flags saying what each figure means.

    ``None`` means "not measurable here" (a missing backend). On CPU every figure is
    *process-level* (``process_level=True``): ``allocated_gb`` and ``reserved_gb`` are the resident
    set size of the whole process (not only tensors), ``peak_gb`` its peak since the last
    :func:`reset_peak_memory`, ``free_gb``/``total_gb`` the machine's (or the cgroup's, when it
    has a smaller limit) available and total memory.

    Attributes:
        device: the device measured (``"cuda:0"``, ``"mps"``, ``"cpu"``).
        allocated_gb: memory in live tensors now (CPU: process RSS).
        reserved_gb: memory held from the system by the allocator (CUDA: reserved by the caching
            allocator; MPS: the Metal driver allocation; CPU: process RSS).
        peak_gb: highest ``allocated`` since the last reset.
        free_gb: memory still available on the device (all processes).
        total_gb: the device's total memory (MPS: the recommended working-set limit).
        available: False when the device's backend is missing (all figures are then None).
        process_level: the figures describe the whole process, not the tensor allocator.
        allocated_exact: ``allocated_gb`` is exactly the bytes in live tensors.
        peak_exact: ``peak_gb`` is a true high-water mark (not a maximum of samples).
        source: where the figures come from, in words.

    Example:
        >>> from opake.profiling import get_memory_stats
        >>> stats = get_memory_stats("cpu")
        >>> stats.process_level, stats.allocated_gb > 0
        (True, True)
    """

    device: str
    allocated_gb: float | None
    reserved_gb: float | None
    peak_gb: float | None
    free_gb: float | None
    total_gb: float | None
    available: bool
    process_level: bool
    allocated_exact: bool
    peak_exact: bool
    source: str

    def utilization(self) -> float | None:
        """Fraction of the device's total memory in use, all processes (``1 - free/total``)."""
        if self.free_gb is None or not self.total_gb:
            return None
        return 1.0 - self.free_gb / self.total_gb

    def efficiency(self) -> float | None:
        """``allocated / reserved`` of the tensor allocator; low values mean fragmentation.

        None on CPU (process-level figures have no allocator cache to compare with).
        """
        if self.process_level or self.allocated_gb is None or not self.reserved_gb:
            return None
        return self.allocated_gb / self.reserved_gb

    def to_dict(self, prefix: str = "") -> dict[str, float]:
        """The measured figures as ``{prefix + name: value}`` (figures that are None left out)."""
        figures = {
            "memory_allocated_gb": self.allocated_gb,
            "memory_reserved_gb": self.reserved_gb,
            "memory_peak_gb": self.peak_gb,
            "memory_free_gb": self.free_gb,
            "memory_total_gb": self.total_gb,
            "memory_utilization": self.utilization(),
        }
        return {f"{prefix}{k}": v for k, v in figures.items() if v is not None}

    def describe(self) -> str:
        """One human-readable line (what :func:`print_memory` prints)."""
        if not self.available:
            return f"{self.device}: memory statistics {self.source}"

        def fmt(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.3f} GB"

        scope = "process-level, " if self.process_level else ""
        peak_kind = "" if self.peak_exact else " (sampled)"
        used = self.utilization()
        util = "" if used is None else f" ({100 * used:.1f}% in use)"
        return (
            f"{self.device} [{scope}{self.source}]: allocated {fmt(self.allocated_gb)}, "
            f"reserved {fmt(self.reserved_gb)}, peak {fmt(self.peak_gb)}{peak_kind}, "
            f"free {fmt(self.free_gb)} of {fmt(self.total_gb)}{util}"
        )


def _stats(backend: _Backend) -> MemoryStats:
    free, total = backend.free_total()
    allocated, reserved, peak = backend.snapshot()
    return MemoryStats(
        device=backend.key,
        allocated_gb=_gb(allocated),
        reserved_gb=_gb(reserved),
        peak_gb=_gb(peak),
        free_gb=_gb(free),
        total_gb=_gb(total),
        available=backend.available,
        process_level=backend.process_level,
        allocated_exact=backend.allocated_exact,
        peak_exact=backend.peak_exact,
        source=backend.source,
    )


def get_memory_stats(device: Any) -> MemoryStats:
    """Memory figures for ``device`` now (see :class:`MemoryStats` for what each one means).

    Never raises for a backend missing from this torch build or machine: the result then has
    ``available=False`` and ``None`` figures.

    Raises:
        InputTypeError: ``device`` is not a device (see :func:`opake.profiling.step_perf`).

    Example:
        >>> from opake.profiling import get_memory_stats
        >>> get_memory_stats("cpu").peak_gb >= get_memory_stats("cpu").allocated_gb * 0.5
        True
    """
    return _stats(_backend(device))


def print_memory(device: Any, label: str = "", *, file: IO[str] | None = None) -> MemoryStats:
    """Print one line of memory figures for ``device``, prefixed by ``label``; returns them.

    Example:
        >>> import io
        >>> from opake.profiling import print_memory
        >>> buf = io.StringIO()
        >>> stats = print_memory("cpu", "start", file=buf)
        >>> buf.getvalue().startswith("[start] cpu [process-level")
        True
    """
    stats = get_memory_stats(device)
    prefix = f"[{label}] " if label else ""
    print(prefix + stats.describe(), file=file if file is not None else sys.stdout)
    return stats


def reset_peak_memory(device: Any) -> None:
    """Start a new peak window on ``device``: ``peak_gb`` then counts from now.

    On CPU (Linux) this writes ``5`` to ``/proc/self/clear_refs``, which resets the kernel's
    peak RSS of this process image (``VmHWM`` in ``/proc/self/status``). It does not reset
    ``resource.getrusage``'s ``ru_maxrss``: that is the maximum over every memory image the
    process had, so a process started by fork + exec (``subprocess``) keeps its parent's peak
    there. An open ``step_perf`` block keeps the peak it saw before the reset.

    Example:
        >>> from opake.profiling import get_memory_stats, reset_peak_memory
        >>> reset_peak_memory("cpu")
        >>> stats = get_memory_stats("cpu")
        >>> stats.peak_gb >= stats.allocated_gb * 0.99
        True
    """
    _reset_window(_backend(device))


def empty_cache(device: Any) -> None:
    """Collect garbage and give cached, unused memory on ``device`` back to the system.

    CUDA/MPS/accelerators: the allocator's ``empty_cache``. CPU: glibc ``malloc_trim(0)`` where
    available (returns freed heap pages, so the process RSS drops back). A no-op for a missing
    backend.

    Example:
        >>> from opake.profiling import empty_cache
        >>> empty_cache("cpu")
    """
    backend = _backend(device)
    gc.collect()
    backend.empty_cache()
