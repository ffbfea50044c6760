"""The parts of one model patching, in order, and what each adds to the report.

:func:`apply_parts` runs them on the base model, every change pushed on the caller's
:class:`~opake.patches.Patcher` (so the dispatcher undoes all of them if one fails): the shared
compatibility pieces (KV cache off, checkpoint routing or transform-safe hooks), the family's
``apply``, the loss-only forward, 2-D → 4-D attention masks, unbatched per-example calls (last:
the outermost wrapper), and a note when dropout is active. It returns the report's fields that
say what happened (:class:`Parts`); :mod:`._dispatch` adds the rest and keeps the registry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, TypedDict

from opake.core import ops
from opake.patches.hf._compat import disable_kv_cache, dropout_status, route_gradient_checkpointing
from opake.patches.hf._loss_only import install_loss_only
from opake.patches.hf._mask import install_mask_conversion
from opake.patches.hf._unbatched import install_unbatched_calls
from opake.patches.model._contract import FamilyApply, read_family_patch

if TYPE_CHECKING:
    import torch

    from opake.core.plugins import ModelFamily
    from opake.patches._patcher import Patcher
    from opake.patches.model._options import PatchOptions

__all__ = ["KernelUse", "Parts", "apply_parts"]


@dataclass(frozen=True)
class KernelUse:
    """Which backend runs one op, and why."""

    backend: str
    reason: str


class Parts(TypedDict):
    """The fields of a :class:`~opake.patches.ModelPatchReport` that :func:`apply_parts` fills
    in."""

    applied: tuple[str, ...]
    kernels: Mapping[str, KernelUse]
    skipped: Mapping[str, str]
    notes: tuple[str, ...]


def apply_parts(
    base: torch.nn.Module, family: ModelFamily, options: PatchOptions, patcher: Patcher
) -> Parts:
    """Apply every part to ``base`` (each change pushed on ``patcher``); what was applied,
    the kernels the patches call, what was skipped and why, and notes for the caller."""
    applied: list[str] = []
    skipped: dict[str, str] = {}
    kernels: dict[str, KernelUse] = {}
    notes: list[str] = []
    if options.compat:
        if disable_kv_cache(base, patcher):
            applied.append("kv_cache: config.use_cache=False")
        if options.vmap_checkpointing:
            n = route_gradient_checkpointing(base, patcher)
            applied.append(
                "gradient_checkpointing: routed to the vmap-safe checkpoint, use_reentrant=False"
                + (f" ({n} modules already enabled)" if n else "")
            )
        else:
            from opake.patches.runtime._hf import make_hooks_transform_safe, restore_hooks

            changed = make_hooks_transform_safe(base)
            if changed:
                patcher.push(lambda: restore_hooks(changed))
            skipped["gradient_checkpointing"] = "vmap_checkpointing=False"
    else:
        skipped["compat"] = "compat=False"
    apply: FamilyApply = family.load_apply()
    result = apply(base, options)
    fields = read_family_patch(result, family.name)
    patcher.push(result.undo)
    applied.extend(fields["applied"])
    kernels.update({op: KernelUse(*use) for op, use in fields["kernels"].items()})
    skipped.update(fields["skipped"])
    hf = fields["hf"]
    head = hf.head if hf is not None else None
    if not options.performance:
        skipped["loss_only"] = "performance=False"
    elif head is None:
        skipped["loss_only"] = f"family {family.name!r} describes no causal-LM head for this model"
    elif options.loss_kernel is None:
        skipped["loss_only"] = options.loss_kernel_reason
    else:
        install_loss_only(base, head, options.loss_kernel, patcher)
        applied.append(
            f"loss_only: {ops.LINEAR_CROSS_ENTROPY} via the {options.loss_kernel.backend} backend"
        )
        kernels[ops.LINEAR_CROSS_ENTROPY] = KernelUse(
            options.loss_kernel.backend, options.loss_kernel.reason
        )
    attention = hf.attention if hf is not None else None
    if not options.compat:
        pass
    elif attention is None:
        skipped["attention_mask"] = f"family {family.name!r} describes no attention kind"
    else:
        install_mask_conversion(base, attention, patcher)
        applied.append(f"attention_mask: 2-D masks become 4-D float additive ({attention})")
    if options.compat:  # last: the outermost wrapper, so every other part sees a batch
        install_unbatched_calls(base, patcher)
        applied.append(
            "unbatched_calls: a 1-D input_ids (one example, as under vmap) runs as a batch of "
            "one; its outputs come back without the batch dimension"
        )
    active = dropout_status(base)
    if active:
        notes.append(
            "dropout is active in training mode ("
            + ", ".join(active[:4])
            + (", ..." if len(active) > 4 else "")
            + "): under vmap pass randomness='different' (e.g. clipped_grad(..., "
            "randomness='different')) so each example draws its own mask, or call model.eval()."
        )
    return {
        "applied": tuple(applied),
        "kernels": MappingProxyType(kernels),
        "skipped": MappingProxyType(skipped),
        "notes": tuple(notes),
    }
