"""Turn a :class:`~opake.models.FamilySpec` into patches on one model instance.

:func:`apply_family` is what every family module's ``apply`` calls, and implements
opake-patches' family contract (:class:`opake.patches.FamilyApply`): it receives the
unwrapped Hugging Face model and the frozen :class:`~opake.patches.PatchOptions`, checks that
the model has the structure the spec describes (fail closed: a transformers version that
renamed or reshaped a module raises instead of being patched wrongly), applies what is
family-specific, and *describes* the rest to the dispatcher in ``hf``
(:class:`~opake.patches.HFCompat`):

* kernel swaps (``performance``): RMSNorm and gated-MLP modules call opake-kernels ops;
* sliding-window masks (``compat``): the backbone receives per-layer-type windowed masks
  (:mod:`opake.models._masks`);
* ``hf.attention`` — causal or bidirectional 2-D → 4-D mask conversion — and ``hf.head`` — the
  loss-only head, with the logit transform read from the config through the spec's
  :class:`~opake.models.LogitTransform`, the same object that reproduces the logits path.

Every change is recorded in a :class:`~opake.patches.Patcher` and undone, newest first, by
:meth:`FamilyReport.undo` — also when a later step fails (all or nothing).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opake.core import ops
from opake.core.errors import ConfigurationError, InputTypeError
from opake.models._masks import install_window_masks
from opake.models._moe import example_aux_loss, install_aux_logits_path, install_moe
from opake.models._spec import CausalLMHead, FamilySpec, LogitTransform
from opake.models._swaps import (
    KernelSlot,
    gated_op,
    modules_of_class,
    swap_gated_mlps,
    swap_rms_norms,
)
from opake.patches import HFCompat, LossOnlyHead, Patcher, PatchOptions
from opake.patches.hf import resolve_path

if TYPE_CHECKING:
    import torch

__all__ = ["FamilyReport", "apply_family", "unwrap_model"]

_log = logging.getLogger("opake.models")

_REPORT_ATTR = "_opake_family_report"


@dataclass
class FamilyReport:
    """What :func:`apply_family` did to one model (an :class:`opake.patches.FamilyPatch`).

    Attributes:
        family: the family name.
        model_type: the model's ``config.model_type``.
        task: ``"causal_lm"`` or ``"sequence_classification"``.
        applied: one line per patch applied (``"rms_norm: 5 LlamaRMSNorm modules"``).
        kernels: op → ``(backend, reason)`` for every kernel the family's patches call.
        skipped: part → reason, for every part of the spec that was not applied.
        hf: what the dispatcher applies next: the attention kind and the loss-only head.
        tied: whether the output projection shares its weight with the input embedding
            (its per-example gradient is then the sum of both uses); None without a LM head.
        transform: the logit transform the head applies (None without a LM head).
        layer: class name of the decoder layers (the gradient-checkpoint boundary).
    """

    family: str
    model_type: str
    task: str
    applied: list[str] = field(default_factory=list)
    kernels: dict[str, tuple[str, str]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    hf: HFCompat | None = None
    tied: bool | None = None
    transform: LogitTransform | None = None
    layer: str = ""
    _patcher: Patcher = field(default_factory=Patcher, repr=False)

    @property
    def active(self) -> bool:
        """True while the patches are in place (until :meth:`undo`)."""
        return len(self._patcher) > 0

    def undo(self) -> None:
        """Restore the instance exactly as it was before :func:`apply_family` (idempotent)."""
        self._patcher.undo()


def unwrap_model(model: object) -> torch.nn.Module:
    """The Hugging Face model inside a PEFT wrapper (the model itself otherwise).

    >>> import torch
    >>> m = torch.nn.Linear(1, 1)
    >>> unwrap_model(m) is m
    True
    """
    from opake.patches.model import unwrap_model as unwrap

    return unwrap(model)


def _model_type(model: torch.nn.Module) -> object:
    """``model.config.model_type`` (None without a config): a Hugging Face model's, by name."""
    return getattr(getattr(model, "config", None), "model_type", None)


def _layer_count(config: object) -> int | None:
    value = getattr(config, "num_hidden_layers", None)
    return value if isinstance(value, int) else None


def _device_of(model: torch.nn.Module) -> torch.device:
    import torch

    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def check_structure(spec: FamilySpec, model: torch.nn.Module) -> list[torch.nn.Module]:
    """Fail closed unless ``model`` looks like the spec says; returns its decoder layers."""
    import transformers

    config = getattr(model, "config", None)
    model_type = _model_type(model)
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
            f"The adapter targets {spec.requires}: update it for this version."
        )
    expected_modules = [spec.norm.module]
    if spec.mlp is not None and spec.moe is None:
        expected_modules.append(spec.mlp.module)  # a hybrid's dense layers may all be MoE
    if spec.moe is not None:
        expected_modules.append(spec.moe.block)
    if spec.rope.module is not None:
        expected_modules.append(spec.rope.module)
    missing = [c for c in expected_modules if next(modules_of_class(model, c), None) is None]
    if missing:
        raise ConfigurationError(
            f"family {spec.name!r} expects {missing} modules in {where}; none found. The "
            f"adapter targets {spec.requires}: update it for this version."
        )
    return layers


def _head(spec: FamilySpec, model: torch.nn.Module, report: FamilyReport) -> LossOnlyHead | None:
    """Record tie and transform; the loss-only head to describe, or None (reason recorded)."""
    import torch

    head = spec.head
    if not isinstance(head, CausalLMHead):
        report.skipped["loss_only"] = (
            "sequence-classification head: there is no vocabulary projection to fuse"
        )
        return None
    if type(model).__name__ not in spec.models:
        report.skipped["loss_only"] = (
            f"{type(model).__name__} is not one of the task models {spec.models} the "
            f"{spec.name!r} adapter describes a head for"
        )
        return None
    lm_head = resolve_path(model, head.lm_head)
    embedding = resolve_path(model, head.embedding)
    weight = getattr(lm_head, "weight", None)
    if weight is None or getattr(embedding, "weight", None) is None:
        raise ConfigurationError(
            f"family {spec.name!r}: {type(model).__name__} has no {head.lm_head}.weight or "
            f"{head.embedding}.weight; this transformers version changed the head."
        )
    report.tied = weight is embedding.weight
    transform = head.transform(model.config)
    report.transform = transform
    if not isinstance(lm_head, torch.nn.Linear):
        report.skipped["loss_only"] = (
            f"{head.lm_head} is a {type(lm_head).__name__}, not a plain Linear (e.g. wrapped by "
            "LoRA): the loss-only path reads its weight alone and would ignore the wrapper"
        )
        return None
    return LossOnlyHead(
        lm_head=head.lm_head,
        backbone=head.backbone,
        logit_scale=transform.scale,
        logit_divisor=transform.divisor,
        softcap=transform.softcap,
        aux_loss=example_aux_loss if spec.moe is not None and spec.moe.aux_loss else None,
    )


def apply_family(
    spec: FamilySpec, model: torch.nn.Module, options: PatchOptions | None = None
) -> FamilyReport:
    """Patch one model instance as ``spec`` describes; returns a :class:`FamilyReport`.

    Called by :func:`opake.patches.apply_model_patches` through a family module's ``apply``;
    the dispatcher then installs what ``report.hf`` describes (mask conversion, loss-only
    forward). Called directly, only the family's own patches are applied. Applying twice is a
    no-op that returns the first report.

    Args:
        spec: the family description.
        model: a Hugging Face model of one of ``spec.model_types`` (PEFT-wrapped is fine).
        options: the dispatcher's :class:`~opake.patches.PatchOptions` (default: all on,
            automatic kernel selection). Read here: ``performance``, ``compat`` and the
            ``kernels`` choice per op (``options.kernel_for(op)``).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from opake.models import apply_family, family_spec
        >>> from opake.patches import PatchOptions
        >>> model = LlamaForCausalLM(LlamaConfig(**family_spec("llama").tiny_config))
        >>> report = apply_family(family_spec("llama"), model, PatchOptions(kernels="torch"))
        >>> report.kernels["rms_norm"][0], report.tied, report.hf.attention
        ('torch', False, 'causal')
        >>> report.undo(); "forward" in vars(model.model.norm)
        False
    """
    if not isinstance(spec, FamilySpec):
        raise InputTypeError(f"apply_family(spec, ...): spec must be a FamilySpec, got {spec!r}.")
    if options is None:
        options = PatchOptions()
    if not isinstance(options, PatchOptions):
        raise InputTypeError(
            f"apply_family(options=...): expected an opake.patches.PatchOptions, got "
            f"{type(options).__name__}."
        )
    base = unwrap_model(model)
    previous = vars(base).get(_REPORT_ATTR)
    if isinstance(previous, FamilyReport) and previous.active:
        _log.debug("family %r: %s is already patched", spec.name, type(base).__name__)
        return previous  # idempotent: the instance is already patched
    check_structure(spec, base)  # so config.model_type is one of spec.model_types, a str
    report = FamilyReport(spec.name, str(_model_type(base)), spec.task, layer=spec.layer)
    patcher = report._patcher
    try:
        head = _head(spec, base, report)
        report.hf = HFCompat(spec.attention.mask, head)
        if options.performance:
            _swap_kernels(spec, base, options, report, patcher)
        else:
            report.skipped["kernels"] = "performance=False"
        if options.compat:
            _windows(spec, base, report, patcher)
            _moe(spec, base, report, patcher)
            _sinks(spec, base, report, patcher)
        elif spec.moe is not None:
            report.skipped["moe"] = (
                "compat=False: the MoE blocks keep transformers' forward, which has "
                "data-dependent shapes and does not run under vmap"
            )
        patcher.set_attr(base, _REPORT_ATTR, report)
    except BaseException:
        patcher.undo()
        raise
    _log_report(report, type(base).__name__)
    return report


def _log_report(report: FamilyReport, model_class: str) -> None:
    """Log the family chosen for the model and every part applied, every kernel backend chosen
    and every part skipped with its reason (INFO on ``opake.models``)."""
    _log.info(
        "family %r for %s (model_type %r, %s)",
        report.family,
        model_class,
        report.model_type,
        report.task,
    )
    for line in report.applied:
        _log.info("family %r: applied %s", report.family, line)
    for op, (backend, reason) in report.kernels.items():
        _log.info("family %r: kernel %r -> backend %r (%s)", report.family, op, backend, reason)
    for part, why in report.skipped.items():
        _log.info("family %r: %s not applied: %s", report.family, part, why)


def _windows(
    spec: FamilySpec, model: torch.nn.Module, report: FamilyReport, patcher: Patcher
) -> None:
    backbone = resolve_path(model, spec.head.backbone)
    if backbone is None:
        raise ConfigurationError(
            f"family {spec.name!r}: {type(model).__name__} has no backbone at "
            f"{spec.head.backbone!r}; this transformers version changed the model."
        )
    window = install_window_masks(backbone, model.config, spec.attention, patcher)
    if window is not None:
        where = "sliding layers" if spec.attention.layer_types else "every layer"
        report.applied.append(f"attention_mask: sliding window of {window} keys on {where}")
    if "linear_attention" in (getattr(model.config, "layer_types", None) or ()):
        report.applied.append(
            f"attention_mask: 2-D padding mask for the {spec.attention.linear} layers"
        )


def _moe(spec: FamilySpec, model: torch.nn.Module, report: FamilyReport, patcher: Patcher) -> None:
    if spec.moe is None:
        return
    count = install_moe(model, spec.moe, patcher)
    report.applied.append(
        f"moe: {count} {spec.moe.block} blocks routed per example (dense experts under vmap)"
    )
    if spec.moe.aux_loss and type(model).__name__ in spec.models:
        install_aux_logits_path(model, patcher)
        report.applied.append("moe: the router's load-balancing loss computed per example")


def _sinks(
    spec: FamilySpec, model: torch.nn.Module, report: FamilyReport, patcher: Patcher
) -> None:
    from opake.models.bookkeeping import install_broadcast, install_sinks

    if spec.attention.linear:
        count = install_broadcast(model, patcher)
        if count:
            report.applied.append(f"linear attention: {count} blocks book-keep their decay")
    if not spec.attention.sinks:
        return
    count = install_sinks(model, patcher)
    if count:
        report.applied.append(f"sinks: {count} attention modules book-keep their sinks")


def _swap_kernels(
    spec: FamilySpec,
    model: torch.nn.Module,
    options: PatchOptions,
    report: FamilyReport,
    patcher: Patcher,
) -> None:
    device = _device_of(model)
    if spec.norm.kind == "rms":
        enabled, backend = options.kernel_for(ops.RMS_NORM)
        if enabled:
            slot = KernelSlot(ops.RMS_NORM, backend)
            report.kernels[ops.RMS_NORM] = slot.choose(device)
            count, _why = swap_rms_norms(model, spec.norm, slot, patcher)
            report.applied.append(f"{ops.RMS_NORM}: {count} {spec.norm.module} modules")
        else:
            report.skipped[ops.RMS_NORM] = "kernels option turned it off"
    else:
        report.skipped[ops.RMS_NORM] = f"{spec.norm.module} is a LayerNorm"
    if spec.rope.kind != "none":
        report.skipped[ops.ROPE] = (
            f"{spec.rope.kind} RoPE stays transformers' own: it is applied by a module-level "
            "function, and Opake patches instances only"
        )
    if spec.mlp is None:
        report.skipped["mlp"] = "no dense MLP: every feed-forward block is a mixture of experts"
        return
    op, activation = gated_op(spec.mlp, model)
    if op is None:
        report.skipped["mlp"] = activation
        return
    enabled, backend = options.kernel_for(op)
    if not enabled:
        report.skipped[op] = "kernels option turned it off"
        return
    slot = KernelSlot(op, backend)
    report.kernels[op] = slot.choose(device)
    count = swap_gated_mlps(model, spec.mlp, slot, patcher, activation)
    report.applied.append(f"{op}: {count} {spec.mlp.module} modules ({activation})")
