"""Opake patches (distribution ``opake-patches``).

Runtime patches that make gradient checkpointing and ``save_on_cpu`` work inside
``torch.func`` transforms, the ``apply_model_patches`` dispatcher, and the Hugging Face
compatibility components model families compose.

>>> import opake.patches
>>> opake.patches.__version__
'0.1.0'
"""

from __future__ import annotations

from opake.patches._version import __version__
from opake.patches.runtime import (
    RuntimePatchState,
    apply_runtime_patches,
    is_runtime_patched,
    remove_runtime_patches,
    runtime_patch_state,
)

__all__ = [
    "RuntimePatchState",
    "__version__",
    "apply_runtime_patches",
    "is_runtime_patched",
    "remove_runtime_patches",
    "runtime_patch_state",
]
