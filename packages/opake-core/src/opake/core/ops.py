"""The names of the kernel ops: one contract shared by kernel backends, patches and tests.

A kernel backend (:class:`~opake.core.plugins.KernelBackend`) maps op names to
implementations; code that calls an op selects it by name through
:func:`~opake.core.plugins.select_kernel`. Both sides use these constants, never bare strings,
so a renamed or new op is one edit here. Every op has a reference implementation in the
``torch`` backend of opake-kernels, against which the other backends are tested.

Model ops (every opake-kernels backend implements them, one signature each, see the kernels
guide):

* :data:`LINEAR_CROSS_ENTROPY` — cross-entropy of ``hidden @ weight.T`` without the logits.
* :data:`CROSS_ENTROPY` — cross-entropy on logits.
* :data:`RMS_NORM`, :data:`SWIGLU`, :data:`GEGLU`, :data:`ROPE` — the layer ops.

Clipping ops (used by the DP-SGD engines of opake-core):

* :data:`LINEAR_CROSS_ENTROPY_EXAMPLE_GRADS` — the per-example gradients of the projection
  inside a linear cross-entropy, held implicitly (book-keeping engine).
* :data:`LINEAR_CROSS_ENTROPY_RECORDED` — the loss whose backward also computes those
  per-example norms.
* :data:`CLIP_ACCUMULATE` — ``sums[j] += Σ_i factors[i, j] · nan_to_num(grads[j][i])`` for
  every leaf ``j`` (the vmap engine's scale-and-sum); opake-core has a torch fallback when no
  backend provides it.

>>> from opake.core import ops
>>> ops.CLIP_ACCUMULATE in ops.ALL_OPS, ops.RMS_NORM in ops.MODEL_OPS
(True, True)
>>> len(set(ops.ALL_OPS)) == len(ops.ALL_OPS)
True
"""

from __future__ import annotations

__all__ = [
    "ALL_OPS",
    "CLIPPING_OPS",
    "CLIP_ACCUMULATE",
    "CROSS_ENTROPY",
    "GEGLU",
    "LINEAR_CROSS_ENTROPY",
    "LINEAR_CROSS_ENTROPY_EXAMPLE_GRADS",
    "LINEAR_CROSS_ENTROPY_RECORDED",
    "MODEL_OPS",
    "RMS_NORM",
    "ROPE",
    "SWIGLU",
]

LINEAR_CROSS_ENTROPY = "linear_cross_entropy"
CROSS_ENTROPY = "cross_entropy"
RMS_NORM = "rms_norm"
SWIGLU = "swiglu"
GEGLU = "geglu"
ROPE = "rope"
LINEAR_CROSS_ENTROPY_EXAMPLE_GRADS = "linear_cross_entropy_example_grads"
LINEAR_CROSS_ENTROPY_RECORDED = "linear_cross_entropy_recorded"
CLIP_ACCUMULATE = "clip_accumulate"

#: the ops a model calls (every opake-kernels backend implements all of them)
MODEL_OPS: tuple[str, ...] = (LINEAR_CROSS_ENTROPY, CROSS_ENTROPY, RMS_NORM, SWIGLU, GEGLU, ROPE)
#: the ops the clipping engines call
CLIPPING_OPS: tuple[str, ...] = (
    LINEAR_CROSS_ENTROPY_EXAMPLE_GRADS,
    LINEAR_CROSS_ENTROPY_RECORDED,
    CLIP_ACCUMULATE,
)
#: every op of the contract
ALL_OPS: tuple[str, ...] = MODEL_OPS + CLIPPING_OPS
