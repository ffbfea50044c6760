"""Memory statistics that say how exact they are, on CUDA, MPS, other accelerators and CPU.

One small backend per device kind reads the figures; everything else (``get_memory_stats``,
``step_perf``, the tuner) goes through :func:`_backend`. Figures are GiB (2**30 bytes).

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

import contextlib
import ctypes
import ctypes.util
import errno
import gc
import os
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import IO, TYPE_CHECKING, Any

from opake.profiling._errors import ConfigurationError, InputTypeError

if TYPE_CHECKING:
    import torch

__all__ = [
    "MemoryStats",
    "empty_cache",
    "get_memory_stats",
    "print_memory",
    "reset_peak_memory",
]

GIB = float(1024**3)
_PROC_STATUS = "/proc/self/status"
_PROC_CLEAR_REFS = "/proc/self/clear_refs"
_CGROUP_MAX = "/sys/fs/cgroup/memory.max"
_CGROUP_CURRENT = "/sys/fs/cgroup/memory.current"


def _gb(value: int | None) -> float | None:
    return None if value is None else value / GIB


def resolve_device(device: Any) -> torch.device:
    """Normalise ``device`` (a ``torch.device`` or a string such as ``"cuda:0"``).

    Raises:
        InputTypeError: ``device`` is not a ``torch.device``/``str``, is not a device string torch
            understands, or is the ``meta`` device (which holds no memory).
    """
    import torch

    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, str):
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError) as err:
            raise InputTypeError(
                f"device={device!r} is not a device torch understands ({err}); expected a "
                "torch.device or a string such as 'cpu', 'cuda', 'cuda:1' or 'mps'"
            ) from None
    else:
        raise InputTypeError(
            f"device={device!r} ({type(device).__name__}): expected a torch.device or a string "
            "such as 'cpu', 'cuda:0' or 'mps'"
        )
    if dev.type == "meta":
        raise InputTypeError(
            "device='meta' holds no data and no memory; profile the device the step runs on "
            "('cpu', 'cuda', 'mps', ...)"
        )
    return dev


def _torch_at_least(major: int, minor: int) -> bool:
    import torch

    match = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if match is None:  # pragma: no cover - torch always has a dotted version
        return False
    return (int(match.group(1)), int(match.group(2))) >= (major, minor)


# ---------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------


class _Backend:
    """Reads one device's memory figures (bytes). Subclasses override what they can measure."""

    available: bool = True
    source: str = "not available"
    process_level: bool = False
    allocated_exact: bool = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.key = str(device)

    @property
    def peak_exact(self) -> bool:
        return False

    def synchronize(self) -> None:
        """Wait for queued work on the device (no-op on CPU)."""

    def allocated(self) -> int | None:
        return None

    def reserved(self) -> int | None:
        return None

    def peak(self) -> int | None:
        """Peak since the last :meth:`reset_peak` (sampled backends fold the current value in)."""
        return None

    def snapshot(self) -> tuple[int | None, int | None, int | None]:
        """``(allocated, reserved, peak)`` in one go (backends that can, read them at once)."""
        return self.allocated(), self.reserved(), self.peak()

    def reset_peak(self) -> None:
        """Start a new peak-tracking window."""

    def free_total(self) -> tuple[int | None, int | None]:
        return None, None

    def empty_cache(self) -> None:
        """Return cached, unused memory to the system."""


class _Unavailable(_Backend):
    available = False
    source = "not available (backend missing in this torch build or machine)"


# Sampled peaks (MPS before torch 2.13, CPU where the kernel peak cannot be reset), by device key.
_SAMPLED_PEAK: dict[str, int] = {}


class _Sampled(_Backend):
    """Mixin logic for backends whose peak is the maximum of sampled current values."""

    def _fold(self, current: int | None) -> int | None:
        if current is not None:
            previous = _SAMPLED_PEAK.get(self.key)
            if previous is None or current > previous:
                _SAMPLED_PEAK[self.key] = current
        return _SAMPLED_PEAK.get(self.key)

    def _sample(self) -> int | None:
        return self._fold(self.allocated())

    def peak(self) -> int | None:
        return self._sample()

    def reset_peak(self) -> None:
        _SAMPLED_PEAK.pop(self.key, None)
        self._sample()


class _Cuda(_Backend):
    source = "CUDA caching allocator"
    allocated_exact = True

    def __init__(self, device: torch.device) -> None:
        import torch

        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= count:
            raise ConfigurationError(
                f"device={str(device)!r}: this machine has {count} CUDA device(s) "
                f"(cuda:0..cuda:{count - 1}); pick one of those"
            )
        super().__init__(torch.device("cuda", index))
        self.index = index

    @property
    def peak_exact(self) -> bool:
        return True

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize(self.index)

    def allocated(self) -> int | None:
        import torch

        return int(torch.cuda.memory_allocated(self.index))

    def reserved(self) -> int | None:
        import torch

        return int(torch.cuda.memory_reserved(self.index))

    def peak(self) -> int | None:
        import torch

        return int(torch.cuda.max_memory_allocated(self.index))

    def reset_peak(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(self.index)

    def free_total(self) -> tuple[int | None, int | None]:
        import torch

        free, total = torch.cuda.mem_get_info(self.index)
        return int(free), int(total)

    def empty_cache(self) -> None:
        import torch

        torch.cuda.empty_cache()


class _Mps(_Sampled):
    """MPS: exact peak through ``torch.accelerator`` on torch >= 2.13, else a sampled maximum."""

    allocated_exact = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.exact = _torch_at_least(2, 13) and _accelerator_is("mps")
        self.source = (
            "torch.accelerator memory statistics (MPS)"
            if self.exact
            else "MPS current allocation (peak sampled at entry, marks and exit)"
        )

    @property
    def peak_exact(self) -> bool:
        return self.exact

    def synchronize(self) -> None:
        import torch

        torch.mps.synchronize()

    def allocated(self) -> int | None:
        import torch

        if self.exact:
            return int(torch.accelerator.memory_allocated())
        return int(torch.mps.current_allocated_memory())

    def reserved(self) -> int | None:
        import torch

        return int(torch.mps.driver_allocated_memory())

    def peak(self) -> int | None:
        import torch

        if self.exact:
            return int(torch.accelerator.max_memory_allocated())
        return super().peak()

    def reset_peak(self) -> None:
        import torch

        if self.exact:
            torch.accelerator.reset_peak_memory_stats()
        else:
            super().reset_peak()

    def free_total(self) -> tuple[int | None, int | None]:
        import torch

        total = int(torch.mps.recommended_max_memory())
        used = int(torch.mps.driver_allocated_memory())
        return max(total - used, 0), total

    def empty_cache(self) -> None:
        import torch

        torch.mps.empty_cache()


class _Accelerator(_Backend):
    """Any other ``torch.accelerator`` device type (XPU, ...), through its memory statistics."""

    allocated_exact = True

    def __init__(self, device: torch.device) -> None:
        import torch

        index = torch.accelerator.current_device_index() if device.index is None else device.index
        super().__init__(torch.device(device.type, index))
        self.index = index
        self.source = f"torch.accelerator memory statistics ({device.type})"

    @property
    def peak_exact(self) -> bool:
        return True

    def synchronize(self) -> None:
        import torch

        torch.accelerator.synchronize(self.index)

    def allocated(self) -> int | None:
        import torch

        return int(torch.accelerator.memory_allocated(self.index))

    def reserved(self) -> int | None:
        import torch

        return int(torch.accelerator.memory_reserved(self.index))

    def peak(self) -> int | None:
        import torch

        return int(torch.accelerator.max_memory_allocated(self.index))

    def reset_peak(self) -> None:
        import torch

        torch.accelerator.reset_peak_memory_stats(self.index)

    def free_total(self) -> tuple[int | None, int | None]:
        import torch

        free, total = torch.accelerator.get_memory_info(self.index)
        return int(free), int(total)

    def empty_cache(self) -> None:
        import torch

        torch.accelerator.empty_cache()


# CPU peak mode: "lifetime" (no reset yet: the kernel's VmHWM / getrusage is exact), "proc" (reset
# through /proc/self/clear_refs worked: VmHWM is exact), "sampled" (reset not permitted). (On Linux,
# getrusage's ru_maxrss, the fallback without /proc, also counts the image before the last exec:
# a subprocess's starts at its parent's peak.)
_CPU_PEAK_MODE = {"mode": "lifetime"}


# /proc files stay open (a read through a kept descriptor costs a fraction of open + read + close);
# keyed by process id, because after a fork an inherited descriptor still names the parent.
_PROC_FDS: dict[tuple[int, str, int], int | None] = {}


# errors that say the file will never open here (no /proc, not permitted): remembered; any other
# (out of descriptors, interrupted) is retried on the next call
_PERMANENT = (errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS)


def _proc_fd(path: str, flags: int) -> int | None:
    key = (os.getpid(), path, flags)
    if key not in _PROC_FDS:
        try:
            _PROC_FDS[key] = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
        except OSError as err:
            if err.errno not in _PERMANENT:
                return None
            _PROC_FDS[key] = None
    return _PROC_FDS[key]


def _drop_proc_fd(path: str, flags: int) -> None:
    """Forget (and close) a kept descriptor whose read or write failed: reopen next time."""
    fd = _PROC_FDS.pop((os.getpid(), path, flags), None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def _kb_field(text: bytes, name: bytes) -> int | None:
    start = text.find(name)
    if start < 0:
        return None
    end = text.find(b"kB", start)
    return int(text[start + len(name) : end]) * 1024


def _read_proc_status() -> dict[str, int] | None:
    """``{"VmRSS": bytes, "VmHWM": bytes}`` of this process, or None without ``/proc``."""
    fd = _proc_fd(_PROC_STATUS, os.O_RDONLY)
    if fd is None:
        return None
    try:
        text = os.pread(fd, 1 << 16, 0)
    except OSError:
        _drop_proc_fd(_PROC_STATUS, os.O_RDONLY)
        return None
    rss = _kb_field(text, b"VmRSS:")
    if rss is None:
        return None
    hwm = _kb_field(text, b"VmHWM:")
    return {"VmRSS": rss} if hwm is None else {"VmRSS": rss, "VmHWM": hwm}


def _clear_peak_rss() -> bool:
    """Reset the kernel's peak RSS of this process (``5`` to ``clear_refs``); False if refused."""
    fd = _proc_fd(_PROC_CLEAR_REFS, os.O_WRONLY)
    if fd is None:
        return False
    try:
        os.write(fd, b"5")
    except OSError as err:
        if err.errno not in (*_PERMANENT, errno.EINVAL):  # EINVAL: the kernel lacks "5"
            _drop_proc_fd(_PROC_CLEAR_REFS, os.O_WRONLY)
        return False
    return True


def _lifetime_peak_rss() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # bytes on macOS, kB else


def _cgroup_limit() -> tuple[int, int] | None:
    """``(limit, current)`` bytes of this process's cgroup v2, when it has a memory limit."""
    try:
        with open(_CGROUP_MAX) as fh:
            raw = fh.read().strip()
        if raw == "max":
            return None
        with open(_CGROUP_CURRENT) as fh:
            current = int(fh.read().strip())
        return int(raw), current
    except (OSError, ValueError):
        return None


@lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim`` (returns freed heap pages to the OS), or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        return libc.malloc_trim
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return None


class _Cpu(_Sampled):
    """Process-level figures: RSS now, peak RSS since the last reset."""

    process_level = True
    allocated_exact = False  # RSS is not "bytes in live tensors"

    def __init__(self, device: torch.device) -> None:
        import torch

        super().__init__(torch.device("cpu"))

    @property
    def source(self) -> str:  # type: ignore[override]
        mode = _CPU_PEAK_MODE["mode"]
        if mode == "proc":
            return "process RSS (peak: kernel VmHWM since last reset)"
        if mode == "lifetime":
            return "process RSS (peak: process lifetime high-water mark)"
        return "process RSS (peak sampled at entry, marks and exit)"

    @property
    def peak_exact(self) -> bool:
        mode = _CPU_PEAK_MODE["mode"]
        if mode == "lifetime":
            return _read_proc_status() is not None or _lifetime_peak_rss() is not None
        return mode == "proc"

    def snapshot(self) -> tuple[int | None, int | None, int | None]:
        """RSS (as allocated and reserved) and peak RSS, from one read of ``/proc``."""
        status = _read_proc_status()
        if status is not None:
            rss = status["VmRSS"]
        else:
            import psutil

            rss = int(psutil.Process().memory_info().rss)
        mode = _CPU_PEAK_MODE["mode"]
        peak: int | None = None
        if mode != "sampled":
            if status is not None:
                peak = status.get("VmHWM")
            if peak is None and mode == "lifetime":
                peak = _lifetime_peak_rss()
        if peak is None:
            peak = self._fold(rss)
        return rss, rss, peak

    def allocated(self) -> int | None:
        return self.snapshot()[0]

    def reserved(self) -> int | None:
        return self.snapshot()[1]

    def peak(self) -> int | None:
        return self.snapshot()[2]

    def reset_peak(self) -> None:
        if (
            _CPU_PEAK_MODE["mode"] != "sampled"
            and _read_proc_status() is not None
            and _clear_peak_rss()
        ):
            _CPU_PEAK_MODE["mode"] = "proc"
            return
        _CPU_PEAK_MODE["mode"] = "sampled"
        super().reset_peak()

    def free_total(self) -> tuple[int | None, int | None]:
        import psutil

        vm = psutil.virtual_memory()
        free, total = int(vm.available), int(vm.total)
        cgroup = _cgroup_limit()
        if cgroup is not None and cgroup[0] < total:
            limit, current = cgroup
            total = limit
            free = max(min(free, limit - current), 0)
        return free, total

    def empty_cache(self) -> None:
        trim = _malloc_trim()
        if trim is not None:
            trim(0)


def _accelerator_is(kind: str) -> bool:
    import torch

    accel = getattr(torch, "accelerator", None)
    if accel is None or not accel.is_available():
        return False
    current = accel.current_accelerator()
    return current is not None and current.type == kind


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
