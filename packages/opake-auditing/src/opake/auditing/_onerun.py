"""Guesses from canary scores, and the one-run lower bound (with its result object)."""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from opake.auditing._bound import _check, _probability
from opake.auditing._guesses import (
    GROUP_GUESS_FRACTION,
    GUESS_FRACTIONS,
    _as_scores,
    _best_guesses,
    _plan,
)
from opake.auditing._resolution import could_show
from opake.auditing._result import AuditResult
from opake.auditing._signal import SubsampledGaussian
from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["GROUP_GUESS_FRACTION", "GUESS_FRACTIONS", "draw_inclusion", "one_run_audit"]


def draw_inclusion(count: int, *, seed: int | None = None) -> np.ndarray:
    """Which of ``count`` canaries are included: each independently with probability ½.

    ``seed=None`` draws from OS entropy (the audit is only valid if the auditor's guesses do
    not know the draw); a seed makes a reproducible test.

    Example:
        >>> draw_inclusion(8, seed=0).tolist()
        [False, True, True, True, False, False, False, False]
    """
    import numpy as np

    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigurationError(f"count={count!r}: expected an int >= 1 (the canary count)")
    rng = np.random.default_rng(secrets.randbits(128) if seed is None else seed)
    return rng.random(count) < 0.5


def one_run_audit(
    scores: Any,
    included: Sequence[bool] | Any,
    *,
    claimed_epsilon: float,
    delta: float,
    confidence: float = 0.95,
    guesses: int | tuple[int, int] | None = None,
    kind: str = "custom",
    groups: Sequence[str] | None = None,
    engine: str | None = None,
    mechanism: SubsampledGaussian | None = None,
) -> AuditResult:
    """Guess each canary from its score and bound ε from the number of correct guesses.

    The ``k_in`` highest-scoring canaries are guessed "in", the ``k_out`` lowest "out", the
    rest abstain. With ``guesses=None`` (default) several sizes ``k_in = k_out = k`` are tried
    (:data:`GUESS_FRACTIONS` of m), for every score vector when ``scores`` is a mapping
    (several attacks), each at significance β / (number of tries), and the largest bound is
    reported — a union bound, so the confidence holds for the reported one.

    Args:
        scores: one score per canary (higher = "more likely included"): a sequence, array or
            tensor of m floats, or a mapping attack name → such a vector.
        included: the m truth values from :func:`draw_inclusion`.
        claimed_epsilon: the ε the mechanism claims (from its accountant), for the report.
        delta: the δ of that claim; the bound is for this δ.
        confidence: 1 − β.
        guesses: ``None`` (the grid), ``k`` or ``(k_in, k_out)``.
        kind: what the canaries were (``"gradient"``, ``"input"``, ...), for the report.
        groups: one public label per canary (e.g. :attr:`GradientCanaries.labels`, fixed before
            the inclusion draw). With two or more labels, each group is also guessed on its
            own, abstaining on the others: ``k`` in and ``k`` out with ``k =``
            :data:`GROUP_GUESS_FRACTION` of the group, for every attack — so a leak confined to
            one kind of canary is not diluted by the others. These tries share β too. Only with
            ``guesses=None``.
        engine: the clipping engine the canaries went through, for the report.
        mechanism: what each canary went through (σ, q and T of a DP-SGD run,
            :class:`SubsampledGaussian`), when known: the result then also says what a run
            that exactly meets the claim is expected to show (``expected_if_correct``, from
            simulated audits of the same design; :func:`expected_lower_bound`).

    The result always says the most this audit could prove (``max_provable``: every guess
    right) and, where the audit cannot contradict the claim or a correct run shows ≈ 0, what
    would make it informative (``advice``; :meth:`AuditResult.explain`).

    Example:
        >>> import numpy as np
        >>> included = draw_inclusion(1000, seed=1)
        >>> scores = included + np.random.default_rng(2).normal(0, 0.05, 1000)  # no noise
        >>> result = one_run_audit(scores, included, claimed_epsilon=1.0, delta=1e-5)
        >>> result.correct == result.guesses, result.epsilon_lower_bound > 1.0
        (True, True)
    """
    import numpy as np

    truth = np.asarray(included, dtype=bool).reshape(-1)
    m = int(truth.shape[0])
    _check(m, 0, 0)
    score_sets = _as_scores(scores, m)
    _probability("delta", delta, closed=True)
    beta = 1.0 - _probability("confidence", confidence, closed=False)
    if (
        isinstance(claimed_epsilon, bool)
        or not isinstance(claimed_epsilon, int | float)
        or not (claimed_epsilon >= 0 and math.isfinite(claimed_epsilon))
    ):
        raise ConfigurationError(f"claimed_epsilon={claimed_epsilon!r}: expected a number >= 0")
    if mechanism is not None and not isinstance(mechanism, SubsampledGaussian):
        raise ConfigurationError(
            f"mechanism={mechanism!r}: expected None or a SubsampledGaussian(noise_multiplier=, "
            "sample_rate=, steps=) (the run's σ, q and T)"
        )
    plan = _plan(guesses, groups, m)
    tries = sum(len(counts) for _, _, counts in plan) * len(score_sets)
    level = 1.0 - beta / tries
    best = _best_guesses(score_sets, plan, truth, float(delta), level)
    return AuditResult(
        claimed_epsilon=float(claimed_epsilon),
        delta=float(delta),
        epsilon_lower_bound=float(best["bound"]),
        confidence=float(confidence),
        canaries=m,
        guesses=best["k"][0] + best["k"][1],
        correct=best["correct"],
        guesses_in=best["k"][0],
        guesses_out=best["k"][1],
        attack=best["attack"],
        tries=tries,
        kind=kind,
        group=best["group"],
        engine=engine,
        included=tuple(bool(x) for x in truth),
        scores={name: tuple(float(x) for x in v) for name, v in score_sets.items()},
        **could_show(
            truth,
            plan,
            list(score_sets),
            level=level,
            claimed_epsilon=float(claimed_epsilon),
            epsilon_lower_bound=float(best["bound"]),
            delta=float(delta),
            confidence=float(confidence),
            guesses=guesses,
            groups=groups,
            mechanism=mechanism,
            kind=kind,
        ),
    )
