"""The CPU memory backend: process-level figures (RSS now, peak RSS since the last reset).

The peak is the kernel's ``VmHWM``, reset by writing ``5`` to ``/proc/self/clear_refs`` (exact);
where that reset is not permitted, or without ``/proc``, the peak after a reset is sampled.
``/proc`` files are read through kept descriptors; free memory honours a cgroup v2 limit.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import sys
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING

from opake.profiling._devices import _log, _Sampled

if TYPE_CHECKING:
    import torch

_PROC_STATUS = "/proc/self/status"
_PROC_CLEAR_REFS = "/proc/self/clear_refs"
_CGROUP_MAX = "/sys/fs/cgroup/memory.max"
_CGROUP_CURRENT = "/sys/fs/cgroup/memory.current"


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
def _malloc_trim() -> Callable[[int], int] | None:
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
    def source(self) -> str:
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
        if _CPU_PEAK_MODE["mode"] != "sampled":
            _log.info(
                "cpu: the kernel's peak RSS cannot be reset here (writing %s failed or there is "
                "no /proc): peaks after a reset are sampled at entry, marks and exit",
                _PROC_CLEAR_REFS,
            )
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
