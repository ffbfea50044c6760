"""Opake patches (distribution ``opake-patches``).

* Runtime patches (global, idempotent, reversible): :func:`apply_runtime_patches` makes
  ``torch.utils.checkpoint`` and ``torch.autograd.graph.save_on_cpu`` work inside
  ``vmap(grad(...))``.
* The model-patch dispatcher: :func:`apply_model_patches` finds a model's family through the
  plugin manager and applies it with the shared Hugging Face pieces (:mod:`opake.patches.hf`);
  the family-side contract is :class:`FamilyApply` / :class:`FamilyPatch` /
  :class:`PatchOptions` / :class:`HFCompat`.

>>> import opake.patches
>>> opake.patches.__version__
'0.1.0'
"""

from __future__ import annotations

from opake.patches._patcher import Patcher
from opake.patches._version import __version__
from opake.patches.hf import LossKernel, LossOnlyHead
from opake.patches.model import (
    FamilyApply,
    FamilyPatch,
    FamilyResult,
    HFCompat,
    KernelUse,
    ModelPatchReport,
    PatchOptions,
    apply_model_patches,
    model_patch_report,
    remove_model_patches,
)
from opake.patches.runtime import (
    RuntimePatchState,
    apply_runtime_patches,
    is_runtime_patched,
    remove_runtime_patches,
    runtime_patch_state,
)

__all__ = [
    "FamilyApply",
    "FamilyPatch",
    "FamilyResult",
    "HFCompat",
    "KernelUse",
    "LossKernel",
    "LossOnlyHead",
    "ModelPatchReport",
    "PatchOptions",
    "Patcher",
    "RuntimePatchState",
    "__version__",
    "apply_model_patches",
    "apply_runtime_patches",
    "is_runtime_patched",
    "model_patch_report",
    "remove_model_patches",
    "remove_runtime_patches",
    "runtime_patch_state",
]
