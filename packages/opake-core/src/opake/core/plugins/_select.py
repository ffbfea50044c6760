"""Choose the kernel backend for one op: explicit > OPAKE_KERNEL_BACKEND > automatic > torch."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opake.core.errors import ConfigurationError, InputTypeError, OperationError
from opake.core.plugins._descriptors import KNOWN_DEVICES, KernelBackend
from opake.core.plugins._manager import kernel_backends

__all__ = ["KERNEL_BACKEND_ENV", "KernelChoice", "device_type_of", "select_kernel"]

KERNEL_BACKEND_ENV = "OPAKE_KERNEL_BACKEND"
_REFERENCE = "torch"
_log = logging.getLogger("opake.core")
_reported: set[tuple[str, str, str]] = set()


def _report(choice: KernelChoice, device_type: str, skipped: list[str]) -> KernelChoice:
    """Log an automatic choice once per (op, device type, backend) and return it."""
    key = (choice.op, device_type, choice.backend)
    if key not in _reported:
        _reported.add(key)
        extra = f" (passed over: {'; '.join(skipped)})" if skipped else ""
        _log.info(
            "kernel %r on %s: backend %r, %s%s",
            choice.op,
            device_type,
            choice.backend,
            choice.reason,
            extra,
        )
    return choice


@dataclass(frozen=True)
class KernelChoice:
    """The backend chosen for an op, its implementation, and why it was chosen."""

    op: str
    backend: str
    impl: Callable[..., Any]
    reason: str


def device_type_of(device: object) -> str:
    """``"cpu"``, ``"cuda"``, … from a ``torch.device``, a tensor, or a string like ``"cuda:0"``.

    >>> device_type_of("cuda:1"), device_type_of(None)
    ('cuda', 'cpu')
    """
    if device is None:
        return "cpu"
    dev = getattr(device, "device", device)  # a tensor
    kind = getattr(dev, "type", None)
    if isinstance(kind, str):
        return kind
    if isinstance(dev, str):
        kind = dev.split(":", 1)[0].strip().lower()
        if kind in KNOWN_DEVICES:
            return kind
        raise ConfigurationError(
            f"unknown device {dev!r}; expected one of {KNOWN_DEVICES} (optionally ':index')."
        )
    raise InputTypeError(f"cannot tell the device type of {device!r}.")


def _usable(be: KernelBackend, op: str, device_type: str) -> tuple[bool, str]:
    if op not in be.ops:
        return False, f"backend {be.name!r} has no op {op!r} (it has {sorted(be.ops)})"
    if device_type not in be.devices:
        return False, f"backend {be.name!r} runs on {be.devices}, not on {device_type!r}"
    if not be.is_available():
        return False, f"backend {be.name!r} is not available on this machine"
    return True, ""


def select_kernel(op: str, device: object = None, backend: str | None = None) -> KernelChoice:
    """Select the implementation of *op* for *device*.

    Order: the explicit *backend* argument, then ``OPAKE_KERNEL_BACKEND``, then the available
    backend of highest priority that supports the op on that device, then the ``torch``
    reference. An explicit choice (argument or environment variable) that cannot run raises
    :class:`~opake.core.errors.OperationError`; automatic selection never raises while the
    reference backend is installed; it logs what it chose (logger ``opake.core``, once per
    op, device type and backend) and the backends it passed over.
    """
    if not isinstance(op, str):
        raise InputTypeError(f"op must be a str, got {type(op).__name__}.")
    device_type = device_type_of(device)
    backends = kernel_backends()
    explicit: tuple[str, str] | None = None
    if backend is not None:
        explicit = (backend, "explicit backend argument")
    elif os.environ.get(KERNEL_BACKEND_ENV):
        explicit = (os.environ[KERNEL_BACKEND_ENV].strip(), f"{KERNEL_BACKEND_ENV} is set")
    if explicit is not None:
        name, why = explicit
        if name not in backends:
            raise ConfigurationError(
                f"kernel backend {name!r} ({why}) is not installed; known backends: "
                f"{sorted(backends)}."
            )
        ok, reason = _usable(backends[name], op, device_type)
        if not ok:
            raise OperationError(f"{reason}; it was requested explicitly ({why}).")
        return KernelChoice(op, name, backends[name].load_op(op), why)
    candidates = []
    skipped = []
    for be in backends.values():
        ok, reason = _usable(be, op, device_type)
        if ok:
            candidates.append(be)
        else:
            skipped.append(reason)
    if not candidates:
        raise OperationError(
            f"no installed kernel backend provides op {op!r} on {device_type!r} "
            f"({'; '.join(skipped) or 'no backends installed'}). Install opake-kernels."
        )
    candidates.sort(key=lambda b: (b.priority, b.name == _REFERENCE), reverse=True)
    chosen = candidates[0]
    reason = f"automatic: highest-priority available backend for {op!r} on {device_type!r}"
    if chosen.name == _REFERENCE:
        reason = f"automatic: reference backend for {op!r} on {device_type!r}"
    return _report(KernelChoice(op, chosen.name, chosen.load_op(op), reason), device_type, skipped)
