"""What an audit can show: the largest bound it could prove, the bound a run that exactly meets
the claim is expected to show, and what would make the audit informative.

- **The most it can prove** (:func:`max_provable_bound`): every guess right, in the try with the
  most guesses, at the confidence each try gets (β shared by every try). No mechanism, however
  leaky, makes this audit report more.
- **What a correct run shows** (:func:`expected_lower_bound`): the same audit (canaries, guess
  sizes, attacks, groups, confidence, δ) run on simulated scores of a run that exactly meets
  its claim — the canaries' signal in DP-SGD at the run's σ, q and T
  (:class:`~opake.auditing.SubsampledGaussian`) — repeated; the median is the figure. A bound
  near it is what a correct run gives; a bound at or below it is no alarm.
- **Advice** (:func:`advise`): when the claim is beyond the most provable, or a correct run
  shows ≈ 0, what to change.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opake.auditing._bound import NEGLIGIBLE, epsilon_lower_bound
from opake.auditing._bound import _p_value as p_value
from opake.auditing._guesses import GUESS_FRACTIONS, Plan, _best_guesses, _plan
from opake.auditing._signal import ATTACKS, SubsampledGaussian
from opake.core.errors import ConfigurationError

__all__ = [
    "Advice",
    "advise",
    "canaries_needed",
    "could_show",
    "expected_lower_bound",
    "max_provable_bound",
]

#: simulated projections (steps × canaries) per expected bound, over all its simulations
_SIMULATION_BUDGET = 5e7
#: the canary counts :func:`canaries_needed` tries, up to the largest it checks exactly
_COUNTS = (10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 200_000)
_MOST_CANARIES = _COUNTS[-1]


@dataclass(frozen=True)
class Advice:
    """One change that would make an audit more informative.

    Attributes:
        change: what to change: ``"canaries"`` (more of them), ``"claim"`` (audit a smaller
            ε), ``"steps"`` (more steps or a larger batch) or ``"canary_kind"`` (gradient
            canaries instead of input ones).
        text: why, with the figures, in one sentence.
        value: a suggested value (canary count, ε, steps), or ``None``.
    """

    change: str
    text: str
    value: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """``{"change", "text", "value"}`` (JSON)."""
        return {"change": self.change, "text": self.text, "value": self.value}


def _tries(plan: Plan, attacks: int) -> int:
    return sum(len(counts) for _, _, counts in plan) * attacks


def _plan_for(canaries: int, guesses: Any, groups: Any) -> Plan:
    if isinstance(canaries, bool) or not isinstance(canaries, int) or canaries < 1:
        raise ConfigurationError(f"canaries={canaries!r}: expected an int >= 1")
    return _plan(guesses, groups, canaries)


def max_provable_bound(
    *,
    canaries: int,
    delta: float,
    confidence: float = 0.95,
    guesses: int | tuple[int, int] | None = None,
    groups: Sequence[str] | None = None,
    attacks: int = 1,
    included: Sequence[bool] | Any = None,
) -> float:
    """The largest lower bound an audit of this design can report: a perfect attack.

    The design is that of :func:`~opake.auditing.one_run_audit` (``guesses``, ``groups``,
    ``attacks`` score vectors; every try gets β / (number of tries)). With ``included`` (the
    inclusion draw), the bound its guesses prove when every included canary scores above every
    excluded one — what a mechanism that leaks everything shows in this audit; without it,
    every guess of every try right (as if each group were exactly half included).

    Example:
        >>> round(max_provable_bound(canaries=1000, delta=1e-5), 2)  # every guess right
        5.23
        >>> from opake.auditing import draw_inclusion
        >>> round(max_provable_bound(canaries=1000, delta=1e-5,
        ...     included=draw_inclusion(1000, seed=1000)), 2)  # 512 in: k = 500 misses 12
        4.72
    """
    import numpy as np

    if isinstance(attacks, bool) or not isinstance(attacks, int) or attacks < 1:
        raise ConfigurationError(f"attacks={attacks!r}: expected an int >= 1")
    plan = _plan_for(canaries, guesses, groups)
    level = 1.0 - (1.0 - confidence) / _tries(plan, attacks)
    if included is not None:
        truth = np.asarray(included, dtype=bool).reshape(-1)
        if truth.shape != (canaries,):
            raise ConfigurationError(f"included has {truth.size} entries for {canaries} canaries")
        perfect = {"perfect": truth.astype(np.float64)}
        return float(_best_guesses(perfect, plan, truth, float(delta), level)["bound"])
    sizes = {k_in + k_out for _, _, counts in plan for k_in, k_out in counts}
    return max(
        epsilon_lower_bound(canaries=canaries, guesses=r, correct=r, delta=delta, confidence=level)
        for r in sizes
    )


def _simulations(canaries: int, steps: int) -> int:
    """9 simulated audits, fewer (at least 3, odd) for large ones."""
    n = int(_SIMULATION_BUDGET // max(1, canaries * steps))
    n = max(3, min(9, n))
    return n if n % 2 else n - 1


def expected_lower_bound(
    mechanism: SubsampledGaussian,
    *,
    canaries: int,
    delta: float,
    confidence: float = 0.95,
    guesses: int | tuple[int, int] | None = None,
    groups: Sequence[str] | None = None,
    attacks: Sequence[str] = ATTACKS,
    simulations: int | None = None,
    seed: int = 0,
) -> list[float]:
    """The bounds of ``simulations`` simulated audits of a run that exactly meets its claim.

    Each simulation draws which canaries are included (probability ½), simulates their scores
    under ``mechanism`` (:meth:`SubsampledGaussian.scores`, one vector per name in
    ``attacks``) and guesses as :func:`~opake.auditing.one_run_audit` does with the same
    ``guesses``, ``groups``, confidence and δ. Returns the bounds, sorted; their median is what
    such a run is expected to show. ``simulations=None``: 9, fewer (≥ 3) when
    canaries × steps is large. Seeded (``seed``): the figure belongs to the design, not to
    one run.

    Example:
        >>> mechanism = SubsampledGaussian(noise_multiplier=0.96, sample_rate=0.0195, steps=20)
        >>> bounds = expected_lower_bound(mechanism, canaries=1000, delta=2.3e-8)
        >>> len(bounds), max(bounds) < 0.05  # 9 simulated audits, ≈ 0 in every one
        (9, True)
    """
    import numpy as np

    if not isinstance(mechanism, SubsampledGaussian):
        raise ConfigurationError(
            f"mechanism={mechanism!r}: expected a SubsampledGaussian(noise_multiplier=, "
            "sample_rate=, steps=)"
        )
    plan = _plan_for(canaries, guesses, groups)
    names = list(dict.fromkeys(str(a) for a in attacks))
    if not names:
        raise ConfigurationError("attacks is empty; name at least one score vector")
    count = _simulations(canaries, mechanism.steps) if simulations is None else simulations
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigurationError(f"simulations={simulations!r}: expected an int >= 1")
    level = 1.0 - (1.0 - confidence) / _tries(plan, len(names))
    bounds = []
    for rng in (np.random.default_rng([seed, i]) for i in range(count)):
        truth = rng.random(canaries) < 0.5
        scores = mechanism.scores(truth, names, rng)
        best = _best_guesses(scores, plan, truth, float(delta), level)
        bounds.append(float(best["bound"]))
    return sorted(bounds)


def _closed_form(guesses: int, level: float) -> float:
    """Every one of ``guesses`` right at δ = 0: ``−ln(β^(−1/r) − 1)`` (an upper bound of the
    bound with δ > 0)."""
    return -math.log(math.expm1(-math.log(1.0 - level) / guesses))


def canaries_needed(
    epsilon: float, *, delta: float, confidence: float = 0.95, tries: int = 1
) -> int | None:
    """About how many canaries (1, 2, 5 × 10ᵏ) a perfect attack needs to prove more than
    ``epsilon``; ``None`` beyond 200,000.

    A perfect attack on m canaries of which about m/2 − √m/2 are on the smaller side (in or
    out) gets k "in" and k "out" guesses right up to that many; of the default guess sizes, the
    two largest (:data:`GUESS_FRACTIONS`) decide; m is enough when they reject ``epsilon``.

    Example:
        >>> canaries_needed(8.0, delta=1e-8, tries=33)
        50000
    """
    level = 1.0 - (1.0 - confidence) / tries
    for m in _COUNTS:
        if _closed_form(m, level) <= epsilon:
            continue
        smaller_side = m // 2 - math.ceil(math.sqrt(m) / 2)
        for fraction in GUESS_FRACTIONS[-2:]:
            k = max(1, min(m // 2, round(fraction * m)))
            correct = 2 * k - max(0, k - smaller_side)
            if p_value(m, 2 * k, correct, epsilon, delta) <= 1.0 - level:  # ε is rejected
                return m
    return None


def _nice_below(value: float) -> float:
    """A round ε about half of ``value`` (what to claim to leave room for a violation)."""
    for nice in (8.0, 4.0, 2.0, 1.0, 0.5):
        if nice <= value / 2:
            return nice
    return 0.25


def advise(
    *,
    claimed_epsilon: float,
    epsilon_lower_bound: float = 0.0,
    max_provable: float,
    expected: float | None,
    mechanism: SubsampledGaussian | None,
    canaries: int,
    delta: float,
    confidence: float,
    tries: int,
    kind: str,
) -> tuple[Advice, ...]:
    """What would make this audit informative (nothing when it already is, and nothing after
    a violation: a bound above the claim is the most informative outcome).

    Example:
        >>> [a.change for a in advise(claimed_epsilon=8.0, max_provable=4.6, expected=0.8,
        ...     mechanism=None, canaries=1000, delta=1e-8, confidence=0.95, tries=33,
        ...     kind="gradient")]
        ['claim', 'canaries']
    """
    out: list[Advice] = []
    if epsilon_lower_bound > claimed_epsilon:
        return ()
    if max_provable <= claimed_epsilon:
        target = _nice_below(max_provable)
        out.append(
            Advice(
                "claim",
                f"audit a smaller claim: this audit proves at most {max_provable:.2f}, so a claim "
                f"such as ε = {target:g} leaves room for a violation to show",
                target,
            )
        )
        needed = canaries_needed(claimed_epsilon, delta=delta, confidence=confidence, tries=tries)
        if needed is None:
            text = (
                f"more canaries cannot make ε = {claimed_epsilon:.3g} contradictable: no audit of "
                f"up to {_MOST_CANARIES:,} canaries proves that much at δ = {delta:.3g}"
            )
        else:
            text = (
                f"or use about {needed:,} canaries (instead of {canaries:,}): with every guess "
                f"right they would prove more than the claimed {claimed_epsilon:.3g}"
            )
        out.append(Advice("canaries", text, None if needed is None else needed))
    if expected is not None and expected < NEGLIGIBLE and mechanism is not None:
        if mechanism.draws < 2.0:
            steps = math.ceil(5.0 / mechanism.sample_rate)
            out.append(
                Advice(
                    "steps",
                    f"each included canary is in q·T = {mechanism.draws:.2g} batches on average "
                    f"(q = {mechanism.sample_rate:.3g}, {mechanism.steps} steps): most are never "
                    f"drawn, so a correct run shows nothing; more steps or a larger batch give "
                    f"each several draws: {steps} steps give q·T = 5",
                    steps,
                )
            )
        elif not any(a.change == "canaries" for a in out):
            out.append(
                Advice(
                    "canaries",
                    f"at σ = {mechanism.noise_multiplier:.3g} the noise hides the canaries of a "
                    f"correct run: more canaries (each tenfold adds about one unit to what can "
                    f"be shown) or a larger ε",
                    10 * canaries,
                )
            )
    if kind == "input":
        out.append(
            Advice(
                "canary_kind",
                "input canaries are scored by the trained model's loss (black-box), far weaker "
                "than the white-box attack the expected figure assumes: gradient canaries see "
                "every step",
            )
        )
    return tuple(out)


def could_show(
    truth: Any,
    plan: Plan,
    attacks: Sequence[str],
    *,
    level: float,
    claimed_epsilon: float,
    epsilon_lower_bound: float,
    delta: float,
    confidence: float,
    guesses: int | tuple[int, int] | None,
    groups: Sequence[str] | None,
    mechanism: SubsampledGaussian | None,
    kind: str,
) -> dict[str, Any]:
    """What one audit could show, as :class:`~opake.auditing.AuditResult` fields: the perfect
    attack's bound on its inclusion draw ``truth`` (``plan`` tried at ``level`` each), the
    simulated audits of a correct run when ``mechanism`` is known, and the advice."""
    perfect = _best_guesses({"perfect": truth * 1.0}, plan, truth, delta, level)
    most = float(perfect["bound"])
    simulated = None
    if mechanism is not None:
        simulated = expected_lower_bound(
            mechanism,
            canaries=int(truth.shape[0]),
            delta=delta,
            confidence=confidence,
            guesses=guesses,
            groups=groups,
            attacks=attacks,
        )
    expected = None if simulated is None else float(statistics.median(simulated))
    return {
        "max_provable": most,
        "max_provable_guesses": (perfect["correct"], sum(perfect["k"])),
        "expected_if_correct": expected,
        "expected_range": None if simulated is None else (simulated[0], simulated[-1]),
        "simulations": 0 if simulated is None else len(simulated),
        "mechanism": mechanism,
        "advice": advise(
            claimed_epsilon=claimed_epsilon,
            epsilon_lower_bound=epsilon_lower_bound,
            max_provable=most,
            expected=expected,
            mechanism=mechanism,
            canaries=int(truth.shape[0]),
            delta=delta,
            confidence=confidence,
            tries=sum(len(counts) for _, _, counts in plan) * len(attacks),
            kind=kind,
        ),
    }
