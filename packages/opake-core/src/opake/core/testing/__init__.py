"""Test helpers shared by every Opake distribution (not used at run time).

- :func:`per_example_grads_loop`, :func:`reference_clipped_sum`, :func:`reference_clipped_grad`:
  the trusted oracle for per-example clipping — a Python loop of plain ``torch.autograd.grad``,
  clipped and summed in float64. Every DP claim is tested against it; compare with
  :func:`assert_grads_close`.
- :func:`tiny_mlp`, :func:`tiny_llama`, :func:`tiny_gpt2`, :func:`with_lora`,
  :func:`causal_lm_loss`: tiny models built from configs (no download) and a per-example loss.

>>> from opake.core.testing import reference_clipped_grad
>>> callable(reference_clipped_grad)
True
"""

from __future__ import annotations

from opake.core.testing._models import causal_lm_loss, tiny_gpt2, tiny_llama, tiny_mlp, with_lora
from opake.core.testing._reference import (
    assert_grads_close,
    per_example_grads_loop,
    reference_clipped_grad,
    reference_clipped_sum,
)

__all__ = [
    "assert_grads_close",
    "causal_lm_loss",
    "per_example_grads_loop",
    "reference_clipped_grad",
    "reference_clipped_sum",
    "tiny_gpt2",
    "tiny_llama",
    "tiny_mlp",
    "with_lora",
]
