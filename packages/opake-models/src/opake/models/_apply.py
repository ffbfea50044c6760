"""Turn a :class:`~opake.models.FamilySpec` into patches on one model instance.

:func:`apply_family` is what every family module's ``apply`` calls. It checks that the model
has the structure the spec describes (fail closed: a transformers version that renamed or
reshaped a module raises instead of being patched wrongly), then applies the kernel swaps the
spec allows. Every change is recorded and undone, in reverse, by :meth:`FamilyReport.undo` —
also when a later step fails (all or nothing).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError
from opake.models._spec import CausalLMHead, FamilySpec, LogitTransform
from opake.models._swaps import (
    KernelSlot,
    Undo,
    gated_op,
    modules_of_class,
    swap_gated_mlps,
    swap_rms_norms,
)

if TYPE_CHECKING:
    import torch

__all__ = ["FamilyReport", "apply_family", "kernel_backend_for", "unwrap_model"]

_REPORT_ATTR = "_opake_family_report"


@dataclass
class FamilyReport:
    """What :func:`apply_family` did to one model instance.

    Attributes:
        family: the family name.
        model_type: the model's ``config.model_type``.
        task: ``"causal_lm"`` or ``"sequence_classification"``.
        applied: one line per patch applied (``"rms_norm: 5 LlamaRMSNorm modules"``).
        kernels: op → ``(backend, reason)`` for every kernel the patches call.
        skipped: part → reason, for every part of the spec that was not applied.
        tied: whether the output projection shares its weight with the input embedding
            (its per-example gradient is then the sum of both uses); None without a LM head.
        transform: the logit transform the head applies (None without a LM head).
    """

    family: str
    model_type: str
    task: str
    applied: list[str] = field(default_factory=list)
    kernels: dict[str, tuple[str, str]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    tied: bool | None = None
    transform: LogitTransform | None = None
    _undo: Undo = field(default_factory=Undo, repr=False)

    @property
    def active(self) -> bool:
        """True while the patches are in place (until :meth:`undo`)."""
        return len(self._undo) > 0

    def undo(self) -> None:
        """Restore the instance exactly as it was before :func:`apply_family` (idempotent)."""
        self._undo()


def unwrap_model(model: Any) -> torch.nn.Module:
    """The Hugging Face model inside a PEFT wrapper (the model itself otherwise).

    >>> import torch
    >>> m = torch.nn.Linear(1, 1)
    >>> unwrap_model(m) is m
    True
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(
            f"expected a torch.nn.Module (a Hugging Face model, optionally PEFT-wrapped), got "
            f"{type(model).__name__}."
        )
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    return base if isinstance(base, torch.nn.Module) else model


def _option(options: Any, name: str, default: Any) -> Any:
    if options is None:
        return default
    if isinstance(options, Mapping):
        return options.get(name, default)
    value = getattr(options, name, default)
    return default if value is None and default is not None else value


def kernel_backend_for(options: Any, op: str) -> tuple[bool, str | None]:
    """Read the ``kernels`` option for one op: ``(enabled, backend or None for automatic)``.

    ``kernels`` may be None/True (automatic), False (no kernel swaps), a backend name for
    every op, or a mapping op → backend name / None / False.

    >>> kernel_backend_for({"kernels": "chunked"}, "rms_norm")
    (True, 'chunked')
    >>> kernel_backend_for({"kernels": {"swiglu": False}}, "swiglu")
    (False, None)
    """
    kernels = _option(options, "kernels", None)
    if isinstance(kernels, Mapping):
        kernels = kernels.get(op)
    if kernels is None or kernels is True:
        return True, None
    if kernels is False:
        return False, None
    if isinstance(kernels, str):
        return True, kernels
    raise InputTypeError(
        f"kernels={kernels!r} for op {op!r}: expected None/True (automatic), False (off), a "
        "backend name such as 'chunked', or a mapping op -> one of those."
    )


def _layer_count(config: Any) -> int | None:
    value = getattr(config, "num_hidden_layers", None)
    return value if isinstance(value, int) else None


def _device_of(model: torch.nn.Module) -> torch.device:
    import torch

    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _resolve(model: Any, path: str) -> Any:
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def check_structure(spec: FamilySpec, model: torch.nn.Module) -> list[torch.nn.Module]:
    """Fail closed unless ``model`` looks like the spec says; returns its decoder layers."""
    import transformers

    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    where = f"{type(model).__name__} (transformers {transformers.__version__})"
    if model_type not in spec.model_types:
        raise ConfigurationError(
            f"family {spec.name!r} handles model types {spec.model_types}, but {where} has "
            f"config.model_type={model_type!r}."
        )
    layers = list(modules_of_class(model, spec.layer))
    expected = _layer_count(config)
    if not layers or (expected is not None and len(layers) != expected):
        raise ConfigurationError(
            f"family {spec.name!r} expects {expected} layers of class {spec.layer} in {where}, "
            f"found {len(layers)}: this transformers version changed the model's structure. "
            f"The adapter targets {spec.requires}; update it or patch with performance=False."
        )
    if spec.norm.kind == "rms" and next(modules_of_class(model, spec.norm.module), None) is None:
        raise ConfigurationError(
            f"family {spec.name!r} expects {spec.norm.module} modules in {where}; none found."
        )
    return layers


def _head_facts(spec: FamilySpec, model: torch.nn.Module, report: FamilyReport) -> None:
    head = spec.head
    if not isinstance(head, CausalLMHead):
        report.skipped["loss_only"] = (
            "sequence-classification head: there is no vocabulary projection to fuse"
        )
        return
    if type(model).__name__ not in spec.models:
        report.skipped["loss_only"] = (
            f"{type(model).__name__} is not one of the task models {spec.models} the "
            f"{spec.name!r} adapter patches heads for"
        )
        return
    lm_head = _resolve(model, head.lm_head)
    embedding = _resolve(model, head.embedding)
    weight = getattr(lm_head, "weight", None)
    if weight is None or getattr(embedding, "weight", None) is None:
        raise ConfigurationError(
            f"family {spec.name!r}: {type(model).__name__} has no {head.lm_head}.weight or "
            f"{head.embedding}.weight; this transformers version changed the head."
        )
    report.tied = weight is embedding.weight
    report.transform = head.transform(model.config)


def apply_family(spec: FamilySpec, model: Any, options: Any = None) -> FamilyReport:
    """Patch one model instance as ``spec`` describes; returns a :class:`FamilyReport`.

    Applying twice is a no-op that returns the first report.

    Args:
        spec: the family description.
        model: a Hugging Face model of one of ``spec.model_types`` (PEFT-wrapped is fine).
        options: the patch options from :func:`opake.patches.apply_model_patches` (an object
            with attributes, or a mapping). Read here: ``performance`` (kernel swaps, default
            True) and ``kernels`` (see :func:`kernel_backend_for`).

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from opake.models import apply_family, family_spec
        >>> cfg = LlamaConfig(**family_spec("llama").tiny_config)
        >>> model = LlamaForCausalLM(cfg)
        >>> report = apply_family(family_spec("llama"), model, {"kernels": "torch"})
        >>> report.kernels["rms_norm"][0], report.tied
        ('torch', False)
        >>> report.undo(); "forward" in model.model.norm.__dict__
        False
    """
    if not isinstance(spec, FamilySpec):
        raise InputTypeError(f"apply_family(spec, ...): spec must be a FamilySpec, got {spec!r}.")
    base = unwrap_model(model)
    previous = base.__dict__.get(_REPORT_ATTR)
    if isinstance(previous, FamilyReport) and previous.active:
        return previous  # idempotent: the instance is already patched
    check_structure(spec, base)
    report = FamilyReport(spec.name, base.config.model_type, spec.task)
    undo = Undo()
    try:
        _head_facts(spec, base, report)
        if _option(options, "performance", True):
            _swap_kernels(spec, base, options, report, undo)
        else:
            report.skipped["kernels"] = "performance=False"
    except BaseException:
        undo()
        raise
    base.__dict__[_REPORT_ATTR] = report
    undo.push(lambda: base.__dict__.pop(_REPORT_ATTR, None))
    report._undo.extend(undo)
    return report


def _swap_kernels(
    spec: FamilySpec,
    model: torch.nn.Module,
    options: Any,
    report: FamilyReport,
    undo: Undo,
) -> None:
    device = _device_of(model)
    if spec.norm.kind == "rms":
        enabled, backend = kernel_backend_for(options, "rms_norm")
        if enabled:
            slot = KernelSlot("rms_norm", backend)
            report.kernels["rms_norm"] = slot.choose(device)
            count, _why = swap_rms_norms(model, spec.norm, slot, undo)
            report.applied.append(f"rms_norm: {count} {spec.norm.module} modules")
        else:
            report.skipped["rms_norm"] = "kernels option turned it off"
    else:
        report.skipped["rms_norm"] = f"{spec.norm.module} is a LayerNorm"
    op, activation = gated_op(spec.mlp, model)
    if op is None:
        report.skipped["mlp"] = activation
        return
    enabled, backend = kernel_backend_for(options, op)
    if not enabled:
        report.skipped[op] = "kernels option turned it off"
        return
    slot = KernelSlot(op, backend)
    report.kernels[op] = slot.choose(device)
    count = swap_gated_mlps(model, spec.mlp, slot, undo, activation)
    report.applied.append(f"{op}: {count} {spec.mlp.module} modules ({activation})")
