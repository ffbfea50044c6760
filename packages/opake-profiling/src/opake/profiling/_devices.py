"""Device memory backends: one small class per device kind reads its figures (bytes).

CUDA, MPS, other ``torch.accelerator`` devices and missing backends; the CPU backend (process
figures from ``/proc``) is in :mod:`opake.profiling._cpu`, the factory choosing one per device in
:mod:`opake.profiling._memory`.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

from opake.profiling._errors import ConfigurationError, InputTypeError

if TYPE_CHECKING:
    import torch

GIB = float(1024**3)

_log = logging.getLogger("opake.profiling")
#: automatic choices already logged in this process (each is logged once, not on every read)
_LOGGED_ONCE: set[str] = set()


def _log_once(key: str, message: str, *args: Any) -> None:
    """Log an automatic choice at INFO on ``opake.profiling`` the first time it is made."""
    if key not in _LOGGED_ONCE:
        _LOGGED_ONCE.add(key)
        _log.info(message, *args)


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


def _accelerator_is(kind: str) -> bool:
    import torch

    accel = getattr(torch, "accelerator", None)
    if accel is None or not accel.is_available():
        return False
    current = accel.current_accelerator()
    return current is not None and current.type == kind


# ---------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------


class _Backend:
    """Reads one device's memory figures (bytes). Subclasses override what they can measure."""

    available: bool = True
    _source: str = "not available"
    process_level: bool = False
    allocated_exact: bool = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.key = str(device)

    @property
    def source(self) -> str:
        """Where the figures come from, in words (``_source``, or a subclass's property)."""
        return self._source

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
    _source = "not available (backend missing in this torch build or machine)"


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
    _source = "CUDA caching allocator"
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
        self._source = (
            "torch.accelerator memory statistics (MPS)"
            if self.exact
            else "MPS current allocation (peak sampled at entry, marks and exit)"
        )
        if not self.exact:
            _log_once(
                f"sampled:{self.key}",
                "%s: no torch.accelerator memory statistics (torch < 2.13): the peak is sampled "
                "at entry, marks and exit",
                self.key,
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
        self._source = f"torch.accelerator memory statistics ({device.type})"

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
