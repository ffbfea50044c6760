"""Test helpers for model families — opake-models' own and any third party's.

- :func:`tiny_model`: the tiny task model a :class:`~opake.models.FamilySpec` describes.
- The conformance suite a family plugin runs against itself: :func:`run_family_conformance`
  (all checks, one call) or :data:`CHECKS` with :func:`run_check` (one pytest case per check).
  Each check compares the model patched by :func:`opake.patches.apply_model_patches` under
  ``vmap`` against a per-example loop of plain autograd on an unpatched copy;
  :func:`assert_grads_close` is the comparison they use.

>>> from opake.models.testing import CHECKS, tiny_model
>>> tiny_model("llama").config.num_hidden_layers
2
>>> list(CHECKS)[:3]
['registered', 'outputs_match', 'loss_only']
"""

from __future__ import annotations

from opake.models.testing._conformance import (
    CHECKS,
    ConformanceCase,
    ConformanceError,
    assert_grads_close,
    run_check,
    run_family_conformance,
)
from opake.models.testing._tiny import tiny_model

__all__ = [
    "CHECKS",
    "ConformanceCase",
    "ConformanceError",
    "assert_grads_close",
    "run_check",
    "run_family_conformance",
    "tiny_model",
]
