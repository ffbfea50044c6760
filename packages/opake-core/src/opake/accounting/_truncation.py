"""Accounting for fixed-shape (truncated) Poisson sampling.

A fixed-shape sampler draws a Poisson batch (each of the N examples independently with
probability q) and, if it has more than ``B_max`` examples, keeps only ``B_max`` of them; the
batch is padded to ``B_max`` slots with a mask. Whenever no truncation happens its output is
exactly the Poisson sampler's, so the T-step run ``M'`` and the plain Poisson run ``M`` can be
coupled to differ only when some step truncates. The batch size of every step is
Binomial(n, q) whatever the model does, so by a union bound on a dataset of size n

    TV(M(D), M'(D)) ≤ T · P(Binomial(n, q) > B_max) =: T·p_n.

If M is (ε, δ)-DP then for neighbours D, D' (sizes n and n ± 1) and any event S,
``P[M'(D) ∈ S] ≤ P[M(D) ∈ S] + T·p_|D| ≤ e^ε·P[M(D') ∈ S] + δ + T·p_|D|
≤ e^ε·P[M'(D') ∈ S] + δ + T·p_|D| + e^ε·T·p_|D'|``, so M' is (ε, δ')-DP with

    δ' = δ + (1 + e^ε) · T · p_{N+1},

taking the larger neighbour (p_n grows with n). The accountants add this term: ε(δ) is the
smallest ε with δ_Poisson(ε) + (1 + e^ε)·Σ_phases T·p ≤ δ. Choosing ``B_max`` with
:func:`max_batch_size_for` makes the term negligible.
"""

from __future__ import annotations

import math

from opake.accounting._validate import (
    check_positive_int,
    check_sample_rate,
    check_steps,
)
from opake.core.errors import ConfigurationError

__all__ = [
    "fixed_shape_slots",
    "max_batch_size_for",
    "truncation_budget_for",
    "truncation_probability",
]


def truncation_probability(*, dataset_size: int, sample_rate: float, max_batch_size: int) -> float:
    """Per-step probability that a Poisson batch is truncated: P(Binomial(N+1, q) > B_max).

    ``N + 1`` covers the larger of the two neighbouring datasets (add/remove adjacency).

    Example:
        >>> p = truncation_probability(dataset_size=10_000, sample_rate=0.01, max_batch_size=150)
        >>> f"{p:.1e}"
        '1.1e-06'
    """
    from scipy import stats

    n = check_positive_int(dataset_size, "dataset_size")
    q = check_sample_rate(sample_rate)
    b_max = check_positive_int(max_batch_size, "max_batch_size")
    return float(stats.binom.sf(b_max, n + 1, q))


def truncation_budget_for(delta: float, target_epsilon: float | None = None) -> float:
    """The budget for ``steps · P(batch > B_max)`` of fixed-shape sampling, from δ and the target ε.

    The accountant charges ``(1 + e^ε)·T·p`` to δ; with a budget of δ/1000 alone that term
    exceeds δ for ε above ln(999) ≈ 6.9, so a target ε of 8 could not be met. Scaling the budget
    by ``1 + e^target`` keeps the term at a thousandth of δ at the target.

    >>> truncation_budget_for(1e-5)
    1e-08
    >>> truncation_budget_for(1e-5, 8.0) < 1e-8 / 2980
    True
    """
    if target_epsilon is None:
        return delta / 1000
    return max(delta / (1000 * (1.0 + math.exp(min(target_epsilon, 600.0)))), 1e-300)


def max_batch_size_for(
    *, dataset_size: int, sample_rate: float, steps: int, truncation_budget: float = 1e-12
) -> int:
    """Smallest ``B_max`` with ``steps · P(Binomial(N+1, q) > B_max) ≤ truncation_budget``.

    The accountant then adds at most ``(1 + e^ε) · truncation_budget`` to δ.

    Example:
        >>> max_batch_size_for(dataset_size=10_000, sample_rate=0.01, steps=1000)
        189
    """
    from scipy import stats

    n = check_positive_int(dataset_size, "dataset_size")
    q = check_sample_rate(sample_rate)
    t = check_steps(steps, "steps")
    budget = float(truncation_budget)
    if not 0.0 < budget < 1.0:
        raise ConfigurationError(
            f"truncation_budget={truncation_budget!r}: expected a probability in (0, 1), "
            "small next to δ (e.g. δ / 1000)"
        )
    if t == 0:
        return 1
    per_step = budget / t
    dist = stats.binom(n + 1, q)
    b = max(1, int(dist.isf(per_step)))
    while b > 1 and dist.sf(b - 1) <= per_step:
        b -= 1
    while dist.sf(b) > per_step:
        b += 1
    return b


def fixed_shape_slots(
    *,
    dataset_size: int,
    sample_rate: float,
    steps: int,
    delta: float,
    target_epsilon: float | None = None,
    multiple_of: int = 1,
) -> int:
    """The slots ``B_max`` of a fixed-shape sampler, as every Opake front end chooses them.

    The smallest ``B_max`` whose truncation charge is at most :func:`truncation_budget_for`
    (δ/1000 at the target ε) over *steps* steps, rounded up to a multiple of *multiple_of*
    (e.g. the physical batches of all ranks, so every rank's batch has one static shape: more
    slots only lower the truncation probability) and capped at the dataset (a batch never has
    more slots than examples).

    Example:
        >>> fixed_shape_slots(dataset_size=10_000, sample_rate=0.01, steps=1000, delta=1e-8)
        185
        >>> fixed_shape_slots(dataset_size=10_000, sample_rate=0.01, steps=1000, delta=1e-8,
        ...                   multiple_of=8)
        192
    """
    n = check_positive_int(dataset_size, "dataset_size")
    chunks = check_positive_int(multiple_of, "multiple_of")
    needed = max_batch_size_for(
        dataset_size=n,
        sample_rate=sample_rate,
        steps=steps,
        truncation_budget=truncation_budget_for(delta, target_epsilon),
    )
    return min(n, -(-needed // chunks) * chunks)
