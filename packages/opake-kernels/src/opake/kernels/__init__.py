"""Opake kernels: vmap-native kernel backends registered through the ``opake`` plugin hooks.

Each op (:func:`linear_cross_entropy`, :func:`cross_entropy`, :func:`rms_norm`, :func:`swiglu`,
:func:`geglu`, :func:`rope`) takes plain tensors, works inside and outside ``vmap(grad(...))``, and
dispatches to a backend: ``torch`` (reference), ``chunked`` (portable, bounded memory) or
``triton`` (fused GPU kernels), or a third party's. Importing this package imports neither torch
nor triton; backends are imported when first chosen.
:func:`linear_cross_entropy_example_grads` (the ``chunked`` backend) serves the book-keeping
clipping engine: the per-example gradients of the projection inside a linear cross-entropy,
held implicitly; :func:`clip_accumulate` is the vmap engine's fused scale-and-sum. Op names are
the constants of :mod:`opake.core.ops` (one name per op; this package adds none).

>>> import opake.kernels
>>> opake.kernels.__version__
'0.1.0'
>>> opake.kernels.kernel_choice("linear_cross_entropy", "cpu", backend="chunked").backend
'chunked'
"""

from __future__ import annotations

from opake.kernels._api import (
    clip_accumulate,
    cross_entropy,
    geglu,
    kernel_choice,
    linear_cross_entropy,
    linear_cross_entropy_example_grads,
    rms_norm,
    rope,
    swiglu,
)
from opake.kernels._args import REDUCTIONS
from opake.kernels._version import __version__

__all__ = [
    "REDUCTIONS",
    "__version__",
    "clip_accumulate",
    "cross_entropy",
    "geglu",
    "kernel_choice",
    "linear_cross_entropy",
    "linear_cross_entropy_example_grads",
    "rms_norm",
    "rope",
    "swiglu",
]
