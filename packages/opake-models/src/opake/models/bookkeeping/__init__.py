"""Book-keeping rules for the layers of opake-models' families (fused experts, attention sinks).

transformers stores a mixture of experts' weights fused, ``[E, in, out]`` per projection, and
runs each expert on the tokens routed to it. Under the book-keeping engine the patched MoE
block runs those experts with :func:`recorded_experts`: sparse (each expert on its own
tokens, as the family's own code), its output tapped, and each fused weight's per-example
gradients held as an :class:`ExpertGrads` — ghost norms over each example's tokens routed to
each expert (or that block of the gradient materialised, whichever costs less), and the clipped
sum as one matmul per expert (on the CPU one grouped matmul for all experts where the kernel
takes the operands, as the recorded forward's projections). No per-layer ``vmap`` fallback and
no dense dispatch.

:data:`FUSED_EXPERTS` is the engine's rule for those modules (registered by opake-models'
plugin through ``opake_bookkeeping_rules``): ``bookkeeping_plan`` names it for every experts
layer, and a batch-first call of the experts that the patched block did not record itself is
handled from the call's inputs.

:data:`ATTENTION_SINKS` gives GPT-OSS's learned attention sinks their per-example gradients
from the attention's additive mask (a tapped zero per example and head; softmax is shift
invariant), in the patched attention that :func:`install_sinks` installs.
:data:`BROADCAST_PARAMS` does the same for parameters a block reads only broadcast against the
batch (Qwen3-Next's gated delta-net ``A_log``, ``dt_bias``; :func:`install_broadcast`).

>>> import torch
>>> from opake.models.bookkeeping import ExpertGrads
>>> a, b = torch.ones(2, 3), torch.ones(2, 4)  # two tokens, both routed to expert 1 of 2
>>> grads = ExpertGrads(a, b, torch.tensor([0, 0]), (0, 2), batch=1)
>>> grads.shape, [round(v, 4) for v in grads.sq_norms()[0].tolist()]  # ‖2·1₃1₄ᵀ‖² = 4·12
((2, 3, 4), [48.0])
"""

from __future__ import annotations

from opake.models.bookkeeping._broadcast import RULE as BROADCAST_PARAMS
from opake.models.bookkeeping._broadcast import install_broadcast
from opake.models.bookkeeping._grads import ExpertGrads
from opake.models.bookkeeping._record import recorded_experts, supports_recording
from opake.models.bookkeeping._rule import RULE as FUSED_EXPERTS
from opake.models.bookkeeping._sinks import RULE as ATTENTION_SINKS
from opake.models.bookkeeping._sinks import install_sinks

__all__ = [
    "ATTENTION_SINKS",
    "BROADCAST_PARAMS",
    "FUSED_EXPERTS",
    "ExpertGrads",
    "install_broadcast",
    "install_sinks",
    "recorded_experts",
    "supports_recording",
]
