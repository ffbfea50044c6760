"""Global runtime patches: checkpointing and ``save_on_cpu`` inside ``torch.func`` transforms.

>>> from opake.patches.runtime import apply_runtime_patches, remove_runtime_patches
>>> apply_runtime_patches().vmap_checkpointing
True
>>> remove_runtime_patches()
"""

from __future__ import annotations

from opake.patches.runtime._checkpoint import vmap_checkpoint
from opake.patches.runtime._offload import OffloadPolicy, current_offload
from opake.patches.runtime._state import (
    PATCH_NAMES,
    TESTED_TORCH,
    RuntimePatchState,
    apply_runtime_patches,
    is_runtime_patched,
    remove_runtime_patches,
    runtime_patch_state,
)
from opake.patches.runtime._transforms import TransformStack, transform_stack

__all__ = [
    "PATCH_NAMES",
    "TESTED_TORCH",
    "OffloadPolicy",
    "RuntimePatchState",
    "TransformStack",
    "apply_runtime_patches",
    "current_offload",
    "is_runtime_patched",
    "remove_runtime_patches",
    "runtime_patch_state",
    "transform_stack",
    "vmap_checkpoint",
]
