"""What rounding does to the clipped sum itself: bounds of the tensor actually added.

Clipping scales example ``i``'s gradient by ``w ≤ 1`` and adds it to an fp32 sum. The bound
the clip factor comes from must cover the tensor *added*, not the exact ``w·G``. Two ways of
adding occur:

- **scale-and-add** of a tensor ``g`` that exists (the vmap engine's per-example gradients, a
  rule's dense pieces, the exact route's materialised gradient): entry by entry
  ``fl(w·g)``, possibly flushed, then added to the sum. Isolated (the other examples masked),
  every other term is an exact zero and ``|added| ≤ (1 + u)·w·|g| + 2⁻¹⁵⁰`` entry by entry:
  :func:`scaled_add_error`.
- **contraction** ``Σ_t fl(w·a_t) b_tᵀ`` over the recorded factors of an
  :class:`~opake.dpsgd.bookkeeping.OuterSum` (one matrix product over every example's tokens):
  :func:`contraction_error`.

Both return ``(rel, abs)``: ``‖added − w·G‖ ≤ w·rel + abs`` for every ``w ∈ [0, 1]``. The
``abs`` part (flushes near underflow) does not shrink with ``w``; :func:`adjust_factors`
takes it off the factor instead, so that ``w'·bound + abs ≤ w·bound``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from opake.dpsgd.certify._float import ETA, SAFE, U32, gamma32

if TYPE_CHECKING:
    import torch

__all__ = [
    "FINAL",
    "adjust_factors",
    "contraction_error",
    "contraction_factors",
    "contraction_from",
    "division_slack",
    "divisor_up",
    "scaled_add_error",
]

#: what an added tensor may still gain after its bound: an fp64 value converted to fp32, the
#: product with the clip factor where a piece's own ``rel`` does not cover it, and the division
#: by ``normalize_by`` (its fp32 divisor rounded up, so only the quotient rounds); four fp32
#: roundings, ``(1 + u)⁴ ≤ (1 + 4u)(1 + SAFE)``
FINAL = (1.0 + 4.0 * U32) * (1.0 + SAFE)


def scaled_add_error(norm_up: torch.Tensor, numel: int) -> tuple[torch.Tensor, float]:
    """``(rel, abs)`` of adding ``fl(w·g)`` for ``‖g‖ ≤ norm_up`` with ``numel`` entries.

    ``rel = 2u·‖g‖`` covers the product's rounding and one more rounding of the result (an fp64
    piece converted to fp32, or the division by ``normalize_by``); a flushed product only
    shrinks an entry; a product rounded to a subnormal grows by at most ``2⁻¹⁵⁰``, and the
    division by ``normalize_by`` once more: ``abs = ETA·√numel``.

    >>> import torch
    >>> rel, abs_ = scaled_add_error(torch.tensor([1.0]), 4)
    >>> float(rel[0]) == 2 * 2.0**-24, abs_ == 2 * 2.0**-126
    (True, True)
    """
    return norm_up * (2.0 * U32), ETA * math.sqrt(numel)


def contraction_error(
    s: torch.Tensor,
    pa: torch.Tensor,
    pb: torch.Tensor,
    *,
    steps: int,
    rows: int,
    shape: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rel, abs)`` ``[B]`` of ``Σ_t fl(w·a_t) b_tᵀ`` (or ``a_t fl(w·b_t)ᵀ``) summed by one
    fp32 matrix product over ``rows`` token rows (``steps`` of them this example's).

    ``s = Σ_t ‖a_t‖‖b_t‖``, ``pa = Σ_t ‖a_t‖``, ``pb = Σ_t ‖b_t‖`` (upper bounds), ``shape`` the
    parameter's ``(R, C)``. Derivation (``x̃ = fl(w·a)``, read as ``x̄`` and ``b`` as ``ȳ`` by a
    product that may treat subnormals as zero):
    ``‖x̄_t − w a_t‖ ≤ u·w‖a_t‖ + 2·ETA·√R``, ``‖ȳ_t − b_t‖ ≤ ETA·√C``, and the product's own
    error per entry ``≤ γ32(steps)·Σ_t |x̄_t||ȳ_t| + 2·rows·ETA·(1 + γ)`` (each of its ``rows``
    products and additions flushed at most once; additions of the masked examples' exact zeros
    round nothing else); the scaled side may carry up to three roundings (an fp64 factor
    converted, the factor's product, the product with it). Collecting the terms proportional
    to ``w``:
    ``rel = γ32(steps + 3)·s + 2·ETA·(√C·pa + √R·pb)``, and the rest
    ``abs = 3·ETA·(√R·pb + √C·pa) + 4·rows·ETA·√(R·C)``. The same holds for an embedding's
    ``index_add`` of ``fl(w·b_t)`` into the rows of its one-hot ``a_t`` (``pa = T``).

    >>> import torch
    >>> one = torch.ones(1, dtype=torch.float64)
    >>> rel, abs_ = contraction_error(one, one, one, steps=1, rows=1, shape=(1, 1))
    >>> float(rel[0]) < 4e-7, float(abs_[0]) < 1e-36
    (True, True)
    """
    return contraction_from(s, pa, pb, contraction_factors(steps=steps, rows=rows, shape=shape))


def contraction_factors(
    *, steps: int, rows: int, shape: tuple[int, int]
) -> tuple[float, float, float, float]:
    """``(γ32(steps + 3), √R, √C, 4·rows·ETA·√R·√C)``: the constants of
    :func:`contraction_error`.

    >>> contraction_factors(steps=1, rows=1, shape=(4, 9))[1:3]
    (2.0, 3.0)
    """
    rows_r, cols = shape
    root_r, root_c = math.sqrt(rows_r), math.sqrt(cols)
    return gamma32(steps + 3), root_r, root_c, 4.0 * rows * ETA * root_r * root_c


def contraction_from(
    s: torch.Tensor, pa: torch.Tensor, pb: torch.Tensor, factors: tuple[Any, Any, Any, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`contraction_error` from :func:`contraction_factors` (floats, or fp64 0-d
    tensors: the form a compiled caller passes, one graph for every layer shape)."""
    g, root_r, root_c, flush = factors
    rel = s * g + (pa * root_c + pb * root_r) * (2.0 * ETA)
    abs_ = (pb * root_r + pa * root_c) * (3.0 * ETA) + flush
    return rel * (1.0 + SAFE), abs_ * (1.0 + SAFE)


def adjust_factors(
    leaf_factor: torch.Tensor, bound_sq: torch.Tensor, slack: torch.Tensor | None
) -> torch.Tensor:
    """Factors ``w' = max(0, w − slack/bound)`` (fp32, rounded toward zero) for ``[m, L]``.

    A clip state picks ``w`` with ``w·bound ≤`` its per-leaf budget, where ``bound`` covers the
    part of the added tensor's error that scales with ``w``; ``slack`` is the part that does not
    (:func:`contraction_error`'s ``abs``). Then ``‖added‖ ≤ w'·bound + slack ≤ w·bound``.

    >>> import torch
    >>> w = adjust_factors(torch.tensor([[0.5]]), torch.tensor([[4.0]]), torch.tensor([[0.2]]))
    >>> float(w[0, 0]) <= 0.4
    True
    """
    import torch

    if slack is None:
        return leaf_factor
    bound = bound_sq.sqrt()
    cut = torch.where(slack > 0, slack / bound, torch.zeros_like(slack))
    wide = (leaf_factor.double() - cut).clamp(min=0.0)
    wide = torch.where(torch.isfinite(wide), wide, torch.zeros_like(wide))
    rounded = wide.to(torch.float32)
    too_big = rounded.double() > wide
    return torch.where(too_big, torch.nextafter(rounded, torch.zeros_like(rounded)), rounded)


def divisor_up(value: float, device: torch.device) -> torch.Tensor:
    """``normalize_by`` as an fp32 0-d tensor rounded *up*: dividing by it never enlarges a
    quotient beyond the division's own rounding.

    >>> float(divisor_up(3.0, __import__("torch").device("cpu")))
    3.0
    >>> float(divisor_up(0.1, __import__("torch").device("cpu"))) >= 0.1
    True
    """
    import torch

    rounded = torch.tensor(value, dtype=torch.float32)
    if float(rounded) < value:
        rounded = torch.nextafter(rounded, torch.tensor(math.inf, dtype=torch.float32))
    return rounded.to(device)


def division_slack(
    slack: torch.Tensor | None, bound_sq: torch.Tensor, numel: list[int], normalize_by: float
) -> torch.Tensor:
    """``slack`` ``[m, leaves]`` plus what dividing the sum by ``normalize_by`` can add where a
    quotient is subnormal (``2⁻¹⁵⁰`` per entry): ``ETA·√n`` per leaf of ``n`` entries, in the
    sum's units before the division (× ``normalize_by``).

    >>> import torch
    >>> extra = division_slack(None, torch.ones(1, 1), [4], 2.0)
    >>> bool(extra[0, 0] >= 2 * 2.0**-126 * 2.0)
    True
    """
    import torch

    extra = torch.tensor([float(n) for n in numel], dtype=torch.float64, device=bound_sq.device)
    extra = extra.sqrt_().mul_(ETA * normalize_by * FINAL)
    base = slack if slack is not None else torch.zeros_like(bound_sq)
    return base + extra
