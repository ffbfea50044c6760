"""``apply_model_patches``: runtime patches, family dispatch, one report per model (the parts
themselves: :mod:`._parts`); the registry of patched models and the way back."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError
from opake.patches._patcher import Patcher
from opake.patches.model._options import (
    KernelsOption,
    PatchOptions,
    check_kernels,
    resolve_loss_kernel,
)
from opake.patches.model._parts import KernelUse, apply_parts
from opake.patches.runtime._state import (
    RuntimePatchState,
    apply_runtime_patches,
    is_runtime_patched,
    runtime_patch_state,
)

if TYPE_CHECKING:
    import torch

    from opake.core.plugins import ModelFamily

__all__ = [
    "PLUGIN_GUIDE",
    "KernelUse",
    "ModelPatchReport",
    "apply_model_patches",
    "model_patch_report",
    "remove_model_patches",
    "unwrap_model",
]

_log = logging.getLogger("opake.patches")
#: where unsupported-family errors send the user
PLUGIN_GUIDE = "docs/guide/plugins.md"
_OPTION_NAMES = (
    "performance",
    "compat",
    "vmap_checkpointing",
    "fused_linear_cross_entropy",
    "chunked_linear_cross_entropy",
    "kernels",
)


@dataclass(frozen=True)
class ModelPatchReport:
    """What :func:`apply_model_patches` did to one model.

    Attributes:
        family: the family the model was dispatched to.
        model_type: its ``config.model_type``.
        applied: one line per change, family changes first.
        kernels: op → :class:`KernelUse` (backend and reason) for every kernel the patches call.
        skipped: part → why it was not applied.
        notes: things the caller must do (e.g. ``randomness="different"`` for dropout).
        options: the :class:`PatchOptions` the family saw.
        runtime: the runtime patches in place when the model was patched.
    """

    family: str
    model_type: str
    applied: tuple[str, ...]
    kernels: Mapping[str, KernelUse]
    skipped: Mapping[str, str]
    notes: tuple[str, ...]
    options: PatchOptions
    runtime: RuntimePatchState
    _model: weakref.ref[torch.nn.Module] | None = field(default=None, repr=False, compare=False)

    @property
    def active(self) -> bool:
        """True while these patches are on the model."""
        model = self._model() if self._model is not None else None
        entry = _registry.entries.get(model) if model is not None else None
        return entry is not None and entry.report is self

    def remove(self) -> None:
        """Undo these patches (same as :func:`remove_model_patches` on the model)."""
        model = self._model() if self._model is not None else None
        if model is not None and self.active:
            remove_model_patches(model)


@dataclass
class _Entry:
    report: ModelPatchReport
    patcher: Patcher
    key: tuple[Any, ...]


class _Registry:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.entries: weakref.WeakKeyDictionary[torch.nn.Module, _Entry] = (
            weakref.WeakKeyDictionary()
        )


_registry = _Registry()


def unwrap_model(model: object) -> torch.nn.Module:
    """The Hugging Face model inside a PEFT wrapper (the model itself otherwise).

    >>> import torch
    >>> lin = torch.nn.Linear(1, 1)
    >>> unwrap_model(lin) is lin
    True
    """
    from torch import nn

    if not isinstance(model, nn.Module):
        raise InputTypeError(
            f"apply_model_patches(model=...): expected a torch.nn.Module (a Hugging Face model, "
            f"optionally wrapped by PEFT), got {type(model).__name__}."
        )
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        base = get_base()
        if isinstance(base, nn.Module):
            return base
    return model


def _model_type(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str) or not model_type:
        raise ConfigurationError(
            f"{type(model).__name__} has no config.model_type, so no model family can be chosen: "
            "apply_model_patches patches Hugging Face models (PreTrainedModel, optionally "
            "PEFT-wrapped). For other modules use apply_runtime_patches() alone."
        )
    return model_type


def _device_type(model: torch.nn.Module) -> str:
    for p in model.parameters():
        return str(p.device.type)
    return "cpu"


def _family_for(model_type: str) -> ModelFamily:
    from opake.core.plugins import model_families

    families = model_families()
    family = families.get(model_type)
    if family is None:
        supported = ", ".join(sorted(families)) or "none (no model-family plugin is installed)"
        raise ConfigurationError(
            f"model_type {model_type!r} is not supported by any installed model family; "
            f"supported model types: {supported}. Install opake-models, or write a family "
            f"plugin for it (see {PLUGIN_GUIDE})."
        )
    ok, why = family.supported()
    if not ok:
        raise ConfigurationError(
            f"model family {family.name!r} cannot patch this model: {why}. Install a version in "
            f"its supported range, or patch with apply_runtime_patches() only."
        )
    return family


def _runtime(vmap_checkpointing: bool | None) -> RuntimePatchState:
    if vmap_checkpointing is None:
        if not is_runtime_patched():
            _log.info("runtime patches were not installed: installing the defaults")
            return apply_runtime_patches()
        return runtime_patch_state()
    current = runtime_patch_state()
    if vmap_checkpointing and not current.vmap_checkpointing:
        return apply_runtime_patches(vmap_checkpointing=True, save_on_cpu=True)
    if not is_runtime_patched():
        return apply_runtime_patches(vmap_checkpointing=False)
    return current


def apply_model_patches(
    model: Any,
    *,
    performance: bool = True,
    compat: bool = True,
    vmap_checkpointing: bool | None = None,
    fused_linear_cross_entropy: bool | None = None,
    chunked_linear_cross_entropy: bool | int | None = None,
    kernels: KernelsOption = None,
    **unknown: Any,
) -> ModelPatchReport:
    """Patch one Hugging Face model for DP-SGD under ``vmap(grad(...))``; all or nothing.

    1. Runtime patches first (:func:`~opake.patches.apply_runtime_patches`) when none are
       installed (``vmap_checkpointing=True`` installs the checkpoint patch; ``False`` leaves
       ``torch.utils.checkpoint`` alone).
    2. The family of ``model.config.model_type`` is found through the plugin manager
       (``opake.core.plugins.model_families()``); unsupported model types raise
       :class:`~opake.core.errors.ConfigurationError` naming the supported ones. A PEFT model
       is unwrapped to its base model (call this after wrapping).
    3. ``compat``: KV cache off; HF gradient checkpointing routed to the vmap-safe path with
       ``use_reentrant=False`` (unless ``vmap_checkpointing=False``); the "inputs require grad"
       hooks made transform-safe; after the family, 2-D attention masks converted to 4-D float
       additive masks, and unbatched per-example calls accepted (1-D ``input_ids`` — one
       example without its batch dimension, as under ``vmap`` — runs as a batch of one and
       returns unbatched outputs; :mod:`opake.patches.hf._unbatched`).
    4. The family's ``apply(model, options)`` (kernel replacements when ``performance``).
    5. ``performance``: the ``loss_only=True`` forward for causal LMs, using the
       ``linear_cross_entropy`` kernel chosen from ``fused_linear_cross_entropy`` (Triton, CUDA),
       ``chunked_linear_cross_entropy`` (``True``: automatic 2-D tiling; an int: cap on the
       vocabulary tile width; ``False``/``0``: off) and ``kernels``.

    Args:
        model: a Hugging Face model (optionally PEFT-wrapped).
        performance: kernel replacements and the loss-only forward.
        compat: the shared HF compatibility patches.
        vmap_checkpointing: see step 1 and 3 (None: install the runtime patches if none are).
        fused_linear_cross_entropy: True forces the Triton loss kernel (raises where it cannot
            run), False excludes it, None lets selection decide.
        chunked_linear_cross_entropy: True / int forces the chunked loss kernel, False/0
            excludes it, None lets selection decide.
        kernels: None/True (automatic per op), False (no kernel replacements; the loss-only
            forward then uses the ``torch`` reference), a backend name for every op, or a
            mapping op → None/True/False/backend name.

    Returns:
        A frozen :class:`ModelPatchReport`; ``report.remove()`` undoes everything. Applying again
        with the same options returns the same report; other options raise until the model is
        un-patched. Unknown keyword arguments raise ``ConfigurationError``.

    Example:
        >>> import torch
        >>> apply_model_patches(torch.nn.Linear(2, 2))
        Traceback (most recent call last):
        ...
        opake.core.errors.ConfigurationError: Linear has no config.model_type, so no model family can be chosen: apply_model_patches patches Hugging Face models (PreTrainedModel, optionally PEFT-wrapped). For other modules use apply_runtime_patches() alone.
    """  # noqa: E501 - the doctest's expected message is one line
    _check_arguments(unknown, performance, compat, vmap_checkpointing)
    kernels = check_kernels(kernels)
    base = unwrap_model(model)
    model_type = _model_type(base)
    key = (
        performance,
        compat,
        vmap_checkpointing,
        fused_linear_cross_entropy,
        chunked_linear_cross_entropy,
        dict(kernels) if isinstance(kernels, Mapping) else kernels,
    )
    with _registry.lock:
        existing = _registry.entries.get(base)
        if existing is not None:
            if existing.key == key:
                return existing.report
            raise ConfigurationError(
                f"this {type(base).__name__} is already patched with other options "
                f"({dict(zip(_OPTION_NAMES, existing.key, strict=True))}); call "
                "remove_model_patches(model) first."
            )
        family = _family_for(model_type)
        runtime = _runtime(vmap_checkpointing)
        given: dict[str, Any] = dict(zip(_OPTION_NAMES, key, strict=True))
        given["kernels"] = kernels  # the frozen mapping, not the key's copy
        options = _options(base, family.name, model_type, runtime, given)
        patcher = Patcher()
        try:
            parts = apply_parts(base, family, options, patcher)
        except BaseException:
            patcher.undo()
            raise
        report = ModelPatchReport(
            family=family.name,
            model_type=model_type,
            runtime=runtime,
            options=options,
            _model=weakref.ref(base),
            **parts,
        )
        _registry.entries[base] = _Entry(report, patcher, key)
        _log_report(report)
        return report


def _check_arguments(
    unknown: Mapping[str, Any], performance: object, compat: object, vmap_checkpointing: object
) -> None:
    if unknown:
        raise ConfigurationError(
            f"apply_model_patches() got unknown keyword argument(s) {sorted(unknown)}; valid "
            f"ones are {list(_OPTION_NAMES)}."
        )
    for name, value in (("performance", performance), ("compat", compat)):
        if not isinstance(value, bool):
            raise InputTypeError(f"apply_model_patches({name}={value!r}): expected True or False.")
    if vmap_checkpointing is not None and not isinstance(vmap_checkpointing, bool):
        raise InputTypeError(
            f"apply_model_patches(vmap_checkpointing={vmap_checkpointing!r}): expected True, "
            "False or None."
        )


def _options(
    base: torch.nn.Module,
    family: str,
    model_type: str,
    runtime: RuntimePatchState,
    given: dict[str, Any],
) -> PatchOptions:
    """The options the family receives, with the loss kernel resolved (``given``: the
    validated keyword arguments of :func:`apply_model_patches`)."""
    device_type = _device_type(base)
    loss_kernel, loss_reason = resolve_loss_kernel(
        performance=given["performance"],
        kernels=given["kernels"],
        fused=given["fused_linear_cross_entropy"],
        chunked=given["chunked_linear_cross_entropy"],
        device_type=device_type,
    )
    routed = (
        given["compat"] and given["vmap_checkpointing"] is not False and runtime.vmap_checkpointing
    )
    return PatchOptions(
        family=family,
        model_type=model_type,
        device_type=device_type,
        vmap_checkpointing=routed,
        loss_kernel=loss_kernel,
        loss_kernel_reason=loss_reason or (loss_kernel.reason if loss_kernel else ""),
        **{k: v for k, v in given.items() if k != "vmap_checkpointing"},
    )


def _log_report(report: ModelPatchReport) -> None:
    """Every automatic choice and fallback of one patching, on the ``opake.patches`` logger."""
    _log.info(
        "model type %r: family %r; %d part(s) applied", report.model_type, report.family,
        len(report.applied),
    )  # fmt: skip
    for op, use in report.kernels.items():
        _log.info("kernel %r: backend %r (%s)", op, use.backend, use.reason)
    for part, why in report.skipped.items():
        _log.info("%s not applied: %s", part, why)


def remove_model_patches(model: object) -> bool:
    """Undo :func:`apply_model_patches` on *model* (PEFT-wrapped or not); True if it was patched.

    The runtime patches stay (they are global: :func:`~opake.patches.remove_runtime_patches`).

    >>> import torch
    >>> remove_model_patches(torch.nn.Linear(1, 1))
    False
    """
    base = unwrap_model(model)
    with _registry.lock:
        entry = _registry.entries.pop(base, None)
        if entry is None:
            return False
        entry.patcher.undo()
        return True


def model_patch_report(model: object) -> ModelPatchReport | None:
    """The report of the patches currently on *model*, or None.

    >>> import torch
    >>> model_patch_report(torch.nn.Linear(1, 1)) is None
    True
    """
    base = unwrap_model(model)
    with _registry.lock:
        entry = _registry.entries.get(base)
        return entry.report if entry is not None else None
