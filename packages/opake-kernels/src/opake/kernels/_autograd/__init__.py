"""vmap-native autograd scaffolding shared by the ``chunked`` and ``triton`` backends.

Each op is two ``torch.autograd.Function`` classes built around a backend's *cores* (functions
that only ever see plain tensors):

* the forward Function calls the forward core and saves what the backward needs
  (``setup_context`` style, which ``torch.func`` requires);
* its ``backward`` calls a second Function whose forward is the backward core, so the backward
  of a kernel is itself a single call that ``vmap`` can fold;
* both define an explicit ``vmap`` staticmethod: the vmapped dimension is folded into the token
  (row) dimension when the parameters (``weight``/``bias``) are shared, and the op runs once per
  example when they are batched. Weight and bias gradients are produced per *group* of tokens,
  one group per folded example, so ``vmap(grad(loss, argnums=weight))`` yields each example's own
  weight gradient, never a sum across examples.

Kernels therefore never receive a ``BatchedTensor`` (Triton cannot read one), and memory stays
bounded by the backend's tiling whatever the vmap batch size.
"""

from opake.kernels._autograd._ce import make_ce_function
from opake.kernels._autograd._common import apply, apply_tensor
from opake.kernels._autograd._layers import (
    make_pointwise_function,
    make_rms_norm_function,
    make_rope_function,
)
from opake.kernels._autograd._lce import LCEBackwardCore, LCEForwardCore, make_lce_function

__all__ = [
    "LCEBackwardCore",
    "LCEForwardCore",
    "apply",
    "apply_tensor",
    "make_ce_function",
    "make_lce_function",
    "make_pointwise_function",
    "make_rms_norm_function",
    "make_rope_function",
]
