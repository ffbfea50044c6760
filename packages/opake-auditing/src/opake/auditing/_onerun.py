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

__all__ = ["GROUP_GUESS_FRACTION", "GUESS_FRACTIONS", "draw_inclusion", "one_run_audit"]

logger = logging.getLogger("opake.auditing")

#: default guess sizes: k "in" guesses (top scores) and k "out" guesses (bottom scores) with
#: k = fraction × m; every (attack, k) pair is tried at β / (number of pairs) (Bonferroni)
GUESS_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)
#: with ``groups``, each group is also guessed on its own (abstaining on the others): k "in"
#: and k "out" guesses with k = this fraction of the group's size, for every attack
GROUP_GUESS_FRACTION = 0.4


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


def _groups(groups: Any, m: int) -> list[tuple[str, Any]]:
    """``[("all", every index), (label, its indices), ...]``; the labels only with two or more."""
    import numpy as np

    everything = [("all", np.arange(m))]
    if groups is None:
        return everything
    if isinstance(groups, str) or not isinstance(groups, Sequence | np.ndarray):
        raise InputTypeError(
            f"groups={groups!r}: expected one label (a str) per canary, e.g. canaries.labels"
        )
    labels = [str(label) for label in groups]
    if len(labels) != m:
        raise ConfigurationError(f"groups has {len(labels)} labels for {m} canaries; give one each")
    names = list(dict.fromkeys(labels))
    if len(names) < 2:
        return everything
    if "all" in names:
        raise ConfigurationError("groups: 'all' names every canary; use another label")
    array = np.asarray(labels)
    return everything + [(name, np.flatnonzero(array == name)) for name in names]


def _plan(guesses: Any, groups: Any, m: int) -> list[tuple[str, Any, list[tuple[int, int]]]]:
    """The guess sizes to try, per group of canaries: the grid (or ``guesses``) over all of
    them, then ``GROUP_GUESS_FRACTION`` of each labelled group (with the grid only)."""
    import numpy as np

    plan = [("all", np.arange(m), _guess_counts(guesses, m))]
    labelled = _groups(groups, m)[1:]  # checked even where an explicit guess count ignores it
    if guesses is None:
        for name, members in labelled:
            k = min(len(members) // 2, round(GROUP_GUESS_FRACTION * len(members)))
            if k >= 1:
                plan.append((name, members, [(k, k)]))
    return plan


def _best_guesses(
    score_sets: dict[str, Any],
    plan: list[tuple[str, Any, list[tuple[int, int]]]],
    truth: Any,
    delta: float,
    confidence: float,
) -> dict[str, Any]:
    """Every (attack, group, k) try at ``confidence`` each; the one with the largest bound."""
    import numpy as np

    m = int(truth.shape[0])
    best: dict[str, Any] | None = None
    for attack, values in score_sets.items():
        for group, members, counts in plan:
            n = len(members)
            order = members[np.argsort(values[members], kind="stable")]  # lowest first
            for k_in, k_out in counts:
                guess_in = order[n - k_in :] if k_in else order[:0]
                guess_out = order[:k_out]
                correct = int(truth[guess_in].sum() + (~truth[guess_out]).sum())
                bound = epsilon_lower_bound(
                    canaries=m,
                    guesses=k_in + k_out,
                    correct=correct,
                    delta=delta,
                    confidence=confidence,
                )
                logger.debug(
                    "attack %s, %s canaries, k=(%d, %d): %d correct, ε ≥ %.4f",
                    attack,
                    group,
                    k_in,
                    k_out,
                    correct,
                    bound,
                )
                if best is None or bound > best["bound"]:
                    best = {
                        "bound": bound,
                        "attack": attack,
                        "group": group,
                        "k": (k_in, k_out),
                        "correct": correct,
                    }
    assert best is not None
    return best


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
    plan = _plan(guesses, groups, m)
    tries = sum(len(counts) for _, _, counts in plan) * len(score_sets)
    best = _best_guesses(score_sets, plan, truth, float(delta), 1.0 - beta / tries)
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
    )
