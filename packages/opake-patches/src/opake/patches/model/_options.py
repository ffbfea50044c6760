"""The options a family's ``apply`` receives, and how the loss kernel is chosen from them."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from opake.core import ops
from opake.core.errors import ConfigurationError, InputTypeError, OperationError
from opake.patches.hf._loss_only import LossKernel

__all__ = [
    "FLAG_BACKENDS",
    "REFERENCE_BACKEND",
    "KernelsOption",
    "PatchOptions",
    "check_kernels",
    "resolve_loss_kernel",
]

#: the backend each loss flag of ``apply_model_patches`` names (opake-kernels' fused Triton and
#: portable chunked backends): ``True`` (or an int tile cap) requests it from the kernel
#: selection explicitly, so it raises where it cannot run; ``False``/``0`` excludes it from the
#: automatic choice. Any other backend (a third party's) is chosen automatically or by
#: ``kernels=``.
FLAG_BACKENDS: Mapping[str, str] = MappingProxyType(
    {"fused_linear_cross_entropy": "triton", "chunked_linear_cross_entropy": "chunked"}
)
#: the reference backend (``kernels=False``, and an automatic choice a flag excluded)
REFERENCE_BACKEND = "torch"

KernelsOption = None | bool | str | Mapping[str, "str | bool | None"]
_log = logging.getLogger("opake.patches")


def _declared(op: str) -> bool:
    """Whether an installed kernel backend (a plugin's, too) declares *op*."""
    from opake.core.plugins import kernel_backends

    return any(op in be.ops for be in kernel_backends().values())


def check_kernels(kernels: object) -> KernelsOption:
    """Validate the ``kernels`` option; mappings are frozen.

    ``None``/``True``: automatic selection per op; ``False``: no kernel replacements; a backend
    name: that backend for every op; a mapping op → ``None``/``True``/``False``/backend name.

    >>> check_kernels({"rms_norm": "torch"})["rms_norm"]
    'torch'
    """
    if kernels is None or isinstance(kernels, (bool, str)):
        if isinstance(kernels, str) and not kernels:
            raise ConfigurationError("kernels='' : give a backend name such as 'chunked'.")
        return kernels
    if isinstance(kernels, Mapping):
        for op, value in kernels.items():
            if not isinstance(op, str):
                raise InputTypeError(f"kernels: op names must be strings, got {op!r}.")
            if op not in ops.MODEL_OPS and not _declared(op):
                raise ConfigurationError(
                    f"kernels: unknown op {op!r}; the ops a patched model calls are "
                    f"{ops.MODEL_OPS} (opake.core.ops), or an op an installed backend declares."
                )
            if value is not None and not isinstance(value, (bool, str)):
                raise InputTypeError(
                    f"kernels[{op!r}]={value!r}: expected None/True (automatic), False (off) or "
                    "a backend name."
                )
        return MappingProxyType(dict(kernels))
    raise InputTypeError(
        f"kernels={kernels!r}: expected None/True (automatic), False (no kernel replacements), "
        "a backend name such as 'chunked', or a mapping op -> one of those."
    )


@dataclass(frozen=True)
class PatchOptions:
    """What ``apply_model_patches`` asks of a family's ``apply(model, options)``.

    Attributes:
        family: the family name the model was dispatched to.
        model_type: the model's ``config.model_type``.
        device_type: where the model's parameters live (``"cpu"``, ``"cuda"``, ...).
        performance: kernel replacements and the loss-only forward are wanted.
        compat: the shared HF compatibility patches are wanted.
        vmap_checkpointing: HF gradient checkpointing is routed to the vmap-safe path.
        kernels: the user's ``kernels`` option (see :meth:`kernel_for`).
        fused_linear_cross_entropy: as given by the user (None: automatic).
        chunked_linear_cross_entropy: as given by the user (None: automatic).
        loss_kernel: the resolved ``linear_cross_entropy`` implementation for the loss-only
            forward, or None when that path is off (``loss_kernel_reason`` says why).
        loss_kernel_reason: why that kernel (or none) was chosen.

    Example:
        >>> opts = PatchOptions(kernels={"rms_norm": False})
        >>> opts.kernel_for("rms_norm"), opts.kernel_for("swiglu")
        ((False, None), (True, None))
        >>> PatchOptions(performance=False).kernel_for("swiglu")
        (False, None)
    """

    family: str = ""
    model_type: str = ""
    device_type: str = "cpu"
    performance: bool = True
    compat: bool = True
    vmap_checkpointing: bool = True
    kernels: KernelsOption = None
    fused_linear_cross_entropy: bool | None = None
    chunked_linear_cross_entropy: bool | int | None = None
    loss_kernel: LossKernel | None = field(default=None, compare=False)
    loss_kernel_reason: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernels", check_kernels(self.kernels))

    def kernel_for(self, op: str) -> tuple[bool, str | None]:
        """``(enabled, backend)`` for one op: backend None means automatic selection.

        Disabled when ``performance=False``, ``kernels=False`` or ``kernels[op]=False``.
        """
        if not self.performance:
            return False, None
        kernels = self.kernels
        if isinstance(kernels, Mapping):
            kernels = kernels.get(op)
        if kernels is None or kernels is True:
            return True, None
        if kernels is False:
            return False, None
        return True, str(kernels)


def _check_chunked(value: object) -> bool | int | None:
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise InputTypeError(
            f"chunked_linear_cross_entropy={value!r}: expected True (automatic 2-D tiling), a "
            "positive int (cap on the vocabulary tile width), False or 0 (off), or None."
        )
    if value < 0:
        raise ConfigurationError(
            f"chunked_linear_cross_entropy={value}: a vocabulary tile width must be positive "
            "(0 or False turns the chunked backend off)."
        )
    return value


def _flag_requests(fused: bool | None, chunked: bool | int | None) -> dict[str, str]:
    """Backend → the flag that names it, for the flags set to an explicit request."""
    chunk_on = chunked is not None and chunked is not False and chunked != 0
    named = {
        "fused_linear_cross_entropy": (fused is True, f"fused_linear_cross_entropy={fused!r}"),
        "chunked_linear_cross_entropy": (chunk_on, f"chunked_linear_cross_entropy={chunked!r}"),
    }
    return {FLAG_BACKENDS[flag]: why for flag, (on, why) in named.items() if on}


def _flag_exclusions(fused: bool | None, chunked: bool | int | None) -> dict[str, str]:
    """Backend → the flag that turns it off (``False``/``0``) for the automatic choice."""
    off = {
        "fused_linear_cross_entropy": fused is False,
        "chunked_linear_cross_entropy": chunked is not None and not chunked,
    }
    value = {"fused_linear_cross_entropy": fused, "chunked_linear_cross_entropy": chunked}
    return {FLAG_BACKENDS[f]: f"{f}={value[f]!r}" for f, is_off in off.items() if is_off}


def resolve_loss_kernel(
    *,
    performance: bool,
    kernels: KernelsOption,
    fused: bool | None,
    chunked: bool | int | None,
    device_type: str,
) -> tuple[LossKernel | None, str]:
    """Choose the ``linear_cross_entropy`` implementation of the loss-only forward.

    Every choice is made by :func:`~opake.core.plugins.select_kernel`; the options only say
    whether a backend is named explicitly (:data:`FLAG_BACKENDS` maps each flag to its backend):

    * ``fused_linear_cross_entropy=True`` names the ``triton`` backend;
    * ``chunked_linear_cross_entropy=True`` names the ``chunked`` backend with automatic 2-D
      tiling, a positive int ``chunked`` with that cap on the vocabulary tile width;
    * ``kernels`` (a name, or ``kernels["linear_cross_entropy"]``) names a backend, a third
      party's too; ``kernels=False`` names the ``torch`` reference;
    * otherwise the choice is automatic (``OPAKE_KERNEL_BACKEND``, then the available backend
      of highest priority, a third party's too); ``False``/``0`` for a flag excludes its
      backend: an automatic choice of it falls back to the ``torch`` reference, logged.

    Returns ``(kernel, reason)``; ``kernel`` is None (with the reason) when the path is off.
    Contradictory requests raise :class:`~opake.core.errors.ConfigurationError`; a named
    backend that cannot run raises :class:`~opake.core.errors.OperationError`.

    >>> resolve_loss_kernel(performance=False, kernels=None, fused=None, chunked=None,
    ...                     device_type="cpu")
    (None, 'performance=False')
    """
    if fused is not None and not isinstance(fused, bool):
        raise InputTypeError(
            f"fused_linear_cross_entropy={fused!r}: expected True, False or None (automatic)."
        )
    chunked = _check_chunked(chunked)
    requested = _flag_requests(fused, chunked)
    chunk_size: bool | int = True
    if FLAG_BACKENDS["chunked_linear_cross_entropy"] in requested and isinstance(chunked, int):
        chunk_size = chunked  # True (automatic tiling) or a cap on the vocabulary tile width
    if not performance:
        if requested:
            raise ConfigurationError(
                "performance=False turns the loss-only forward off, but fused_linear_cross_entropy"
                " / chunked_linear_cross_entropy asked for it; drop one of them."
            )
        return None, "performance=False"
    if len(requested) > 1:
        raise ConfigurationError(
            f"{' and '.join(requested.values())} ask for two different loss kernels "
            f"({' and '.join(requested)}); choose one."
        )
    named = kernels.get(ops.LINEAR_CROSS_ENTROPY) if isinstance(kernels, Mapping) else kernels
    if isinstance(named, str):
        if requested and named not in requested:
            raise ConfigurationError(
                f"kernels names backend {named!r} for {ops.LINEAR_CROSS_ENTROPY}, which "
                f"contradicts {next(iter(requested.values()))}; choose one."
            )
        return _explicit(device_type, named, f"kernels={named!r}", chunk_size), ""
    if requested:
        backend, why = next(iter(requested.items()))
        return _explicit(device_type, backend, why, chunk_size), ""
    if named is False:
        return _explicit(device_type, REFERENCE_BACKEND, "kernels=False: the torch reference"), ""
    return _automatic(device_type, _flag_exclusions(fused, chunked))


def _explicit(
    device_type: str, backend: str, reason: str, chunk_size: bool | int = True
) -> LossKernel:
    """The named backend's op (raises where it is not installed or cannot run)."""
    from opake.core.plugins import select_kernel

    choice = select_kernel(ops.LINEAR_CROSS_ENTROPY, device_type, backend)
    return LossKernel(choice.backend, choice.impl, chunk_size, reason)


def _automatic(device_type: str, excluded: Mapping[str, str]) -> tuple[LossKernel | None, str]:
    """The selection's automatic choice; the reference where a flag excluded it (logged)."""
    from opake.core.plugins import select_kernel

    try:
        choice = select_kernel(ops.LINEAR_CROSS_ENTROPY, device_type)
    except OperationError as err:
        why = f"no kernel backend provides {ops.LINEAR_CROSS_ENTROPY} on {device_type!r} ({err})"
        _log.info("loss-only forward off: %s", why)
        return None, why
    if choice.backend not in excluded:
        return LossKernel(choice.backend, choice.impl, True, choice.reason), ""
    why = excluded[choice.backend]
    _log.info(
        "%s on %s: automatic choice %r turned off by %s; the torch reference instead",
        ops.LINEAR_CROSS_ENTROPY,
        device_type,
        choice.backend,
        why,
    )
    return _explicit(device_type, REFERENCE_BACKEND, f"{choice.backend} turned off by {why}"), ""


def describe(kernel: Any) -> str:
    """One line for the report: ``"chunked (chunked_linear_cross_entropy=2048)"``."""
    return f"{kernel.backend} ({kernel.reason})"
