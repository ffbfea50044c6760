"""Guesses from canary scores: the guess sizes to try, per group of canaries, and the try with
the largest bound (Bonferroni over every try)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from opake.auditing._bound import epsilon_lower_bound
from opake.core.errors import ConfigurationError, InputTypeError

__all__ = ["GROUP_GUESS_FRACTION", "GUESS_FRACTIONS"]

logger = logging.getLogger("opake.auditing")

#: default guess sizes: k "in" guesses (top scores) and k "out" guesses (bottom scores) with
#: k = fraction × m; every (attack, k) pair is tried at β / (number of pairs) (Bonferroni)
GUESS_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)
#: with ``groups``, each group is also guessed on its own (abstaining on the others): k "in"
#: and k "out" guesses with k = this fraction of the group's size, for every attack
GROUP_GUESS_FRACTION = 0.4

#: the guess sizes of one group of canaries: (group name, its canary indices, [(k_in, k_out)])
Plan = list[tuple[str, Any, list[tuple[int, int]]]]


def _as_scores(scores: Any, m: int) -> dict[str, Any]:
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


def _plan(guesses: Any, groups: Any, m: int) -> Plan:
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
    plan: Plan,
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
