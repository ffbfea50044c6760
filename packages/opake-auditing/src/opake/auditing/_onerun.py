"""Guesses from canary scores, and the one-run lower bound (with its result object)."""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opake.auditing._bound import _check, _probability, epsilon_lower_bound
from opake.auditing._result import AuditResult
from opake.core.errors import ConfigurationError, InputTypeError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["GUESS_FRACTIONS", "draw_inclusion", "one_run_audit"]

logger = logging.getLogger("opake.auditing")

#: default guess sizes: k "in" guesses (top scores) and k "out" guesses (bottom scores) with
#: k = fraction × m; every (attack, k) pair is tried at β / (number of pairs) (Bonferroni)
GUESS_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


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


def _as_scores(scores: Any, m: int) -> dict[str, np.ndarray]:
    import numpy as np

    items = list(scores.items()) if isinstance(scores, Mapping) else [("score", scores)]
    if not items:
        raise ConfigurationError("scores is empty; give at least one score vector")
    out = {}
    for name, value in items:
        raw = value.detach().cpu().double().numpy() if hasattr(value, "detach") else value
        array = np.asarray(raw, dtype=np.float64)
        if array.shape != (m,):
            raise ConfigurationError(
                f"scores[{name!r}] has shape {array.shape}; expected ({m},), one score per canary"
            )
        if not np.isfinite(array).all():
            raise ConfigurationError(
                f"scores[{name!r}] holds non-finite values; scores must be finite numbers"
            )
        out[str(name)] = array
    return out


def _guess_counts(guesses: Any, m: int) -> list[tuple[int, int]]:
    if guesses is None:
        ks = sorted({max(1, min(m // 2, round(f * m))) for f in GUESS_FRACTIONS})
        return [(k, k) for k in ks if 2 * k <= m]
    if isinstance(guesses, int) and not isinstance(guesses, bool):
        guesses = (guesses, guesses)
    if (
        not isinstance(guesses, tuple)
        or len(guesses) != 2
        or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in guesses)
    ):
        raise InputTypeError(
            f"guesses={guesses!r}: expected None (a grid), an int k (k in and k out), or a "
            "pair (k_in, k_out) of ints >= 0"
        )
    if sum(guesses) < 1 or sum(guesses) > m:
        raise ConfigurationError(
            f"guesses={guesses}: expected 1 <= k_in + k_out <= {m} (the canary count)"
        )
    return [guesses]


def one_run_audit(
    scores: Any,
    included: Sequence[bool] | Any,
    *,
    claimed_epsilon: float,
    delta: float,
    confidence: float = 0.95,
    guesses: int | tuple[int, int] | None = None,
    kind: str = "custom",
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
    counts = _guess_counts(guesses, m)
    tries = len(counts) * len(score_sets)
    best: dict[str, Any] | None = None
    for attack, values in score_sets.items():
        order = np.argsort(values, kind="stable")  # ascending: lowest first
        for k_in, k_out in counts:
            guess_in = order[m - k_in :] if k_in else order[:0]
            guess_out = order[:k_out]
            correct = int(truth[guess_in].sum() + (~truth[guess_out]).sum())
            bound = epsilon_lower_bound(
                canaries=m,
                guesses=k_in + k_out,
                correct=correct,
                delta=float(delta),
                confidence=1.0 - beta / tries,
            )
            logger.debug(
                "attack %s k=(%d, %d): %d correct, ε ≥ %.4f", attack, k_in, k_out, correct, bound
            )
            if best is None or bound > best["bound"]:
                best = {
                    "bound": bound,
                    "attack": attack,
                    "k": (k_in, k_out),
                    "correct": correct,
                }
    assert best is not None
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
        included=tuple(bool(x) for x in truth),
        scores={name: tuple(float(x) for x in v) for name, v in score_sets.items()},
    )
