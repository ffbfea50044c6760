"""Test helpers shared by every Opake distribution (not used at run time).

- :func:`per_example_grads_loop`, :func:`reference_clipped_sum`, :func:`reference_clipped_grad`:
  the trusted oracle for per-example clipping — a Python loop of plain ``torch.autograd.grad``,
  clipped and summed in float64. Every DP claim is tested against it; compare with
  :func:`assert_grads_close`.
- :func:`tiny_mlp`, :func:`tiny_llama`, :func:`tiny_gpt2`, :func:`with_lora`,
  :func:`causal_lm_loss`: tiny models built from configs (no download) and a per-example loss.
- :func:`check_rule`: the book-keeping rule conformance check in one call — a plugin author
  runs ``check_rule(RULE)`` in the plugin's tests (every example the rule declares;
  adversarial batches, hypothesis-guided, against the clipping bound with no tolerance and
  against the per-example loop; a rule not yet installed is registered for the check). Its
  parts: :func:`search_rule` (one example), :func:`check_rule_example` (one batch),
  :func:`rule_example_cases` (what Opake's generated test parametrizes over);
  :func:`contribution` and :func:`exact_norm`, what one example alone adds to a clipped sum
  and its norm measured exactly.

>>> from opake.core.testing import reference_clipped_grad
>>> callable(reference_clipped_grad)
True
"""

from __future__ import annotations

from opake.core.testing._conformance import check_rule
from opake.core.testing._isolate import contribution, exact_norm
from opake.core.testing._models import causal_lm_loss, tiny_gpt2, tiny_llama, tiny_mlp, with_lora
from opake.core.testing._reference import (
    assert_grads_close,
    per_example_grads_loop,
    reference_clipped_grad,
    reference_clipped_sum,
)
from opake.core.testing._rules import (
    PATTERNS,
    TOLERANCE,
    adversarial_batch,
    adversarial_tensor,
    check_rule_example,
    rule_example_cases,
    search_rule,
)

__all__ = [
    "PATTERNS",
    "TOLERANCE",
    "adversarial_batch",
    "adversarial_tensor",
    "assert_grads_close",
    "causal_lm_loss",
    "check_rule",
    "check_rule_example",
    "contribution",
    "exact_norm",
    "per_example_grads_loop",
    "reference_clipped_grad",
    "reference_clipped_sum",
    "rule_example_cases",
    "search_rule",
    "tiny_gpt2",
    "tiny_llama",
    "tiny_mlp",
    "with_lora",
]
