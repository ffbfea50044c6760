"""Certified floating-point bounds: the arithmetic the clipping guarantee is proven in.

Every clip factor Opake computes comes from a quantity proven to be at least the L2 norm of
the tensor actually added to the clipped sum for that example, under the assumptions of
:mod:`._float` (IEEE-754 binary32/64, round to nearest, with or without flush-to-zero and
denormals-are-zero, any summation order or blocking, TF32 off). This package holds the pieces
of that proof that both engines use:

- :func:`dense_sq_norms`, :func:`token_norms` — certified squared norms of tensors that exist;
- :func:`gram`, :class:`GramTerms`, :func:`error_bound` — Gram matrices and the rounding bound
  of the Gram ("ghost") norm and inner products;
- :func:`contraction_error`, :func:`scaled_add_error`, :func:`adjust_factors` — what adding a
  scaled gradient (or contracting scaled factors) can add beyond ``w·G``;
- :func:`measure_blocks`, :func:`guarded_add` — the exact route, which adds exactly what it
  measured.

:func:`diagonal_norms` and :func:`contraction_error` also come as their constants
(:func:`diagonal_factors`, :func:`contraction_factors`) and the formula applied to them
(:func:`diagonal_from`, :func:`contraction_from`): a compiled caller passes the constants as
fp64 tensors, so one graph evaluates the very same formula for every layer shape.

The privacy guide's "Proof of the clipping bound" page walks through the argument with
pointers here. See ``README.md`` beside this file.

>>> import torch
>>> from opake.dpsgd.certify import dense_sq_norms
>>> hat, up = dense_sq_norms(torch.tensor([[1.0] + [2.0**-12] * 300]))
>>> bool(up[0] >= 1.0 + 300 * 2.0**-24)
True
"""

from __future__ import annotations

from opake.dpsgd.certify._compiler import ieee_compile_options
from opake.dpsgd.certify._exact import ROW_BLOCK, guarded_add, measure_blocks, row_blocks
from opake.dpsgd.certify._float import (
    BLOCK,
    ETA,
    SAFE,
    U32,
    U64,
    dense_sq_norms,
    full_precision,
    gamma32,
    gamma64,
    token_norms,
)
from opake.dpsgd.certify._gram import (
    WIDE_MACS,
    GramCache,
    GramTerms,
    diagonal_factors,
    diagonal_from,
    diagonal_norms,
    entry_error,
    error_bound,
    gram,
    wide,
)
from opake.dpsgd.certify._sums import (
    FINAL,
    adjust_factors,
    contraction_error,
    contraction_factors,
    contraction_from,
    division_slack,
    divisor_up,
    scaled_add_error,
)

__all__ = [
    "BLOCK",
    "ETA",
    "FINAL",
    "ROW_BLOCK",
    "SAFE",
    "U32",
    "U64",
    "WIDE_MACS",
    "GramCache",
    "GramTerms",
    "adjust_factors",
    "contraction_error",
    "contraction_factors",
    "contraction_from",
    "dense_sq_norms",
    "diagonal_factors",
    "diagonal_from",
    "diagonal_norms",
    "division_slack",
    "divisor_up",
    "entry_error",
    "error_bound",
    "full_precision",
    "gamma32",
    "gamma64",
    "gram",
    "guarded_add",
    "ieee_compile_options",
    "measure_blocks",
    "row_blocks",
    "scaled_add_error",
    "token_norms",
    "wide",
]
