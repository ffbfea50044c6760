"""The ``chunked`` backend: portable, pure-PyTorch kernels with bounded memory (CPU, MPS, CUDA).

Linear cross-entropy tiles tokens and vocabulary in two dimensions under a workspace bound taken
from the device (:func:`workspace_budget`): the (tokens, vocab) logits never exist at once, and
the backward recomputes each tile. The other ops save only their inputs and recompute in
backward. Every op is a ``setup_context`` autograd.Function with an explicit ``vmap`` rule, so
``vmap(grad(...))`` folds examples into the token dimension and returns per-example gradients
(also for a shared weight).

:func:`linear_cross_entropy_example_grads` holds the per-example gradients of the output
projection implicitly (norms, clipped sums and cross terms tile by tile), and
:func:`linear_cross_entropy_recorded` is the loss whose backward computes those norms in the
same tile pass as the hidden states' gradient: the book-keeping clipping engine uses them to
clip with a loss-only forward.

>>> import torch
>>> from opake.kernels.chunked import resolve_chunking
>>> resolve_chunking(True, "cpu", 64, 1000, torch.float32, tokens=8)[0]
8
"""

from __future__ import annotations

from opake.kernels.chunked._example_grads import (
    LinearCEExampleGrads,
    lce_ghost_is_cheaper,
    linear_cross_entropy_example_grads,
)
from opake.kernels.chunked._ops import (
    cross_entropy,
    geglu,
    linear_cross_entropy,
    rms_norm,
    rope,
    swiglu,
)
from opake.kernels.chunked._recorded import RecordedLinearCE, linear_cross_entropy_recorded
from opake.kernels.chunked._workspace import (
    WORKSPACE_CAP,
    available_memory,
    resolve_chunking,
    workspace_budget,
)

__all__ = [
    "WORKSPACE_CAP",
    "LinearCEExampleGrads",
    "RecordedLinearCE",
    "available_memory",
    "cross_entropy",
    "geglu",
    "lce_ghost_is_cheaper",
    "linear_cross_entropy",
    "linear_cross_entropy_example_grads",
    "linear_cross_entropy_recorded",
    "resolve_chunking",
    "rms_norm",
    "rope",
    "swiglu",
    "workspace_budget",
]
