"""The model-patch dispatcher and the family-side contract.

>>> from opake.patches.model import PatchOptions
>>> PatchOptions().performance
True
"""

from __future__ import annotations

from opake.patches.model._contract import FamilyApply, FamilyPatch, FamilyResult, HFCompat
from opake.patches.model._dispatch import (
    PLUGIN_GUIDE,
    KernelUse,
    ModelPatchReport,
    apply_model_patches,
    model_patch_report,
    remove_model_patches,
    unwrap_model,
)
from opake.patches.model._options import FLAG_BACKENDS, PatchOptions, resolve_loss_kernel

__all__ = [
    "FLAG_BACKENDS",
    "PLUGIN_GUIDE",
    "FamilyApply",
    "FamilyPatch",
    "FamilyResult",
    "HFCompat",
    "KernelUse",
    "ModelPatchReport",
    "PatchOptions",
    "apply_model_patches",
    "model_patch_report",
    "remove_model_patches",
    "resolve_loss_kernel",
    "unwrap_model",
]
