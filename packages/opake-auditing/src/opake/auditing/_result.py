"""The result of an audit: claimed ε, the measured lower bound, the guesses, and a plot."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opake.auditing._bound import NEGLIGIBLE
from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    from opake.auditing._resolution import Advice
    from opake.auditing._signal import SubsampledGaussian

__all__ = ["AuditResult"]


@dataclass(frozen=True)
class AuditResult:
    """What one audit measured.

    Attributes:
        claimed_epsilon: ε the mechanism claims (its accountant's figure).
        delta: δ of the claim; the bound is for this δ.
        epsilon_lower_bound: ε that the guesses prove at ``confidence``: with probability at
            least ``confidence`` a mechanism whose true ε (at ``delta``) is below this number
            would not have produced this many correct guesses.
        confidence: 1 − β.
        canaries: m, the number of canaries (each included with probability ½).
        guesses: r, how many canaries were guessed (the others abstained).
        correct: v, how many guesses were right.
        guesses_in: how many of the guesses said "in" (the top scores).
        guesses_out: how many said "out" (the bottom scores).
        attack: the score vector the reported guesses came from.
        tries: how many (attack, guess size) pairs shared β (union bound).
        kind: ``"gradient"`` (white-box), ``"input"`` (black-box) or ``"custom"``.
        group: the canaries the reported guesses were made on: ``"all"``, or one kind of
            canary (the others abstained; see ``one_run_audit(groups=...)``).
        engine: the clipping engine the canaries went through (``"bookkeeping"``,
            ``"vmap"``), or ``None`` when not reported.
        included: the truth, one bool per canary.
        scores: attack name → one score per canary.
        max_provable: the largest bound this audit could report — every guess right (every
            included canary scored above every excluded one), at the confidence each try
            gets — whatever the mechanism leaks (``None``: not computed).
            A claim at or above it cannot be contradicted by this audit.
        max_provable_guesses: ``(correct, guesses)`` of the try that gives ``max_provable``
            (all right, unless the try guesses more "in" than there are included canaries, or
            more "out" than excluded ones).
        expected_if_correct: the bound a run that exactly meets the claim is expected to show:
            the median over ``simulations`` simulated audits of the same design whose canaries
            go through ``mechanism`` (``None`` when the mechanism is not known).
        expected_range: the smallest and largest of those simulated bounds.
        simulations: how many simulated audits gave ``expected_if_correct``.
        mechanism: σ, q and T the canaries went through, when known.
        advice: what would make this audit informative (empty when it is).
        extra: anything the caller adds (settings, run time, ...), written by :meth:`to_dict`.
    """

    claimed_epsilon: float
    delta: float
    epsilon_lower_bound: float
    confidence: float
    canaries: int
    guesses: int
    correct: int
    guesses_in: int = 0
    guesses_out: int = 0
    attack: str = "score"
    tries: int = 1
    kind: str = "custom"
    group: str = "all"
    engine: str | None = None
    included: tuple[bool, ...] = ()
    scores: dict[str, tuple[float, ...]] = field(default_factory=dict)
    max_provable: float | None = None
    max_provable_guesses: tuple[int, int] | None = None
    expected_if_correct: float | None = None
    expected_range: tuple[float, float] | None = None
    simulations: int = 0
    mechanism: SubsampledGaussian | None = None
    advice: tuple[Advice, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def consistent(self) -> bool:
        """True when the lower bound does not exceed the claimed ε (no violation found).

        ``True`` is not a proof of privacy: it only says this audit found no contradiction.
        """
        return self.epsilon_lower_bound <= self.claimed_epsilon

    @property
    def accuracy(self) -> float:
        """Fraction of correct guesses (0.0 with no guesses)."""
        return self.correct / self.guesses if self.guesses else 0.0

    @property
    def verdict(self) -> str:
        """What the bound says about the claim, in words."""
        if not self.consistent:
            return "VIOLATION: the measured lower bound exceeds the claimed ε"
        if self.max_provable is not None and self.max_provable <= self.claimed_epsilon:
            return (
                f"no violation found, and none could show: this audit proves at most "
                f"{self.max_provable:.3f}"
            )
        if self.expected_if_correct is not None and self.expected_if_correct < NEGLIGIBLE:
            return "no violation found, but a correct run shows ≈ 0 here: the audit says little"
        return "no violation found (not a proof of privacy)"

    def summary(self) -> str:
        """One line: claimed ε vs the measured lower bound, and the verdict."""
        engine = f" through the {self.engine} engine" if self.engine else ""
        group = "" if self.group == "all" else f" on the {self.group} canaries"
        return (
            f"claimed ε = {self.claimed_epsilon:.3f}, measured lower bound ε ≥ "
            f"{self.epsilon_lower_bound:.3f} at δ = {self.delta:.3g} with {self.confidence:.0%} "
            f"confidence ({self.correct}/{self.guesses} correct guesses on {self.canaries} "
            f"{self.kind} canaries{engine}, attack {self.attack}{group}): {self.verdict}"
        )

    def explain(self, *, options: Mapping[str, str] | None = None) -> list[str]:
        """What the audit could have shown, how to read the bound, and what would make the
        audit informative: one sentence per line (empty without ``max_provable``).

        ``options`` maps an advice's ``change`` to the command-line option that makes it
        (``{"canaries": "--canary-count"}``): the advice then names the option and its value.

        Example:
            >>> from opake.auditing import draw_inclusion, one_run_audit
            >>> included = draw_inclusion(100, seed=0)
            >>> result = one_run_audit(included * 1.0, included, claimed_epsilon=8.0, delta=0.0)
            >>> for line in result.explain(options={"canaries": "--canary-count"}):
            ...     print(line)  # doctest: +NORMALIZE_WHITESPACE
            at most: ε ≥ 2.455 is the largest bound this audit can prove, when every
            included canary scores above every excluded one (60 of 60 guesses right on 100
            canaries, 7 tries sharing 95% confidence), whatever the mechanism leaks
            reading: no outcome of this audit can contradict ε = 8.000: even every guess right
            proves only 2.455; the bound is no estimate of ε
            to make it informative: audit a smaller claim: this audit proves at most 2.46, so
            a claim such as ε = 1 leaves room for a violation to show
            to make it informative: or use about 50,000 canaries (instead of 100): with every
            guess right they would prove more than the claimed 8 (--canary-count 50000)
        """
        if self.max_provable is None:
            return []
        correct, guesses = self.max_provable_guesses or (self.canaries, self.canaries)
        most = (
            f"at most: ε ≥ {self.max_provable:.3f} is the largest bound this audit can prove, "
            f"when every included canary scores above every excluded one ({correct:,} of "
            f"{guesses:,} guesses right on {self.canaries:,} canaries, {self.tries} tries "
            f"sharing {self.confidence:.0%} confidence), whatever the mechanism leaks"
        )
        lines = [most]
        expected = self.expected_if_correct
        if expected is not None and self.mechanism is not None:
            low, high = self.expected_range or (expected, expected)
            mech = self.mechanism
            lines.append(
                f"expected: a run that exactly meets the claim shows ε ≥ {expected:.3f} "
                f"(median of {self.simulations} simulated audits of its mechanism, "
                f"{low:.2f}–{high:.2f}: σ = {mech.noise_multiplier:.4g}, q = "
                f"{mech.sample_rate:.4g}, {mech.steps} steps)"
            )
        lines.append(f"reading: {self._reading()}")
        for advice in self.advice:
            option = (options or {}).get(advice.change)
            hint = ""
            if option and advice.value is not None:
                hint = f" ({option} {advice.value:g})"
            elif option and advice.change == "canary_kind":
                hint = f" ({option} gradient)"
            lines.append(f"to make it informative: {advice.text}{hint}")
        return lines

    def _reading(self) -> str:
        claimed, most = self.claimed_epsilon, self.max_provable or 0.0
        expected = self.expected_if_correct
        if not self.consistent:
            return (
                f"the bound {self.epsilon_lower_bound:.3f} exceeds the claimed {claimed:.3f}: the "
                "mechanism as built leaks more than its accountant says (group and engine say "
                "where the guesses were made)"
            )
        if most <= claimed:
            return (
                f"no outcome of this audit can contradict ε = {claimed:.3f}: even every guess "
                f"right proves only {most:.3f}; the bound is no estimate of ε"
            )
        if expected is not None and expected < NEGLIGIBLE:
            return (
                f"a correct run shows ≈ 0 at these settings, so this audit cannot measure "
                f"anything about ε here; only a gross fault (noise or clipping missing) would "
                f"show, as a bound above {claimed:.3f}"
            )
        near = "" if expected is None else f"a correct run shows about {expected:.2f}; "
        return (
            f"{near}a bound above the claimed {claimed:.3f} (possible up to {most:.3f}) would "
            "prove the claim wrong; at or below it, no violation was found — not a proof of "
            "privacy, nor an estimate of ε"
        )

    def to_dict(self, *, with_scores: bool = True) -> dict[str, Any]:
        """A JSON-serialisable dict (``audit.json``)."""
        out: dict[str, Any] = {
            "claimed_epsilon": self.claimed_epsilon,
            "delta": self.delta,
            "epsilon_lower_bound": self.epsilon_lower_bound,
            "confidence": self.confidence,
            "consistent": self.consistent,
            "canaries": self.canaries,
            "canary_kind": self.kind,
            "guesses": self.guesses,
            "guesses_in": self.guesses_in,
            "guesses_out": self.guesses_out,
            "correct": self.correct,
            "attack": self.attack,
            "group": self.group,
            "engine": self.engine,
            "tries": self.tries,
            "method": "one-run audit (Steinke, Nasr & Jagielski, NeurIPS 2023, Theorem 3)",
            "verdict": self.verdict,
            "max_provable_epsilon": self.max_provable,
            "max_provable_guesses": (
                None
                if self.max_provable_guesses is None
                else dict(zip(("correct", "guesses"), self.max_provable_guesses, strict=True))
            ),
            "expected_epsilon_if_correct": self.expected_if_correct,
            "expected_epsilon_range": (
                None if self.expected_range is None else list(self.expected_range)
            ),
            "expected_simulations": self.simulations,
            "mechanism": None
            if self.mechanism is None
            else {
                "noise_multiplier": self.mechanism.noise_multiplier,
                "sample_rate": self.mechanism.sample_rate,
                "steps": self.mechanism.steps,
                "draws_per_included_canary": self.mechanism.draws,
            },
            "advice": [advice.to_dict() for advice in self.advice],
            "explanation": self.explain(),
        }
        if with_scores:
            out["included"] = list(self.included)
            out["scores"] = {k: list(v) for k, v in self.scores.items()}
        out.update(self.extra)
        return out

    def write_json(self, path: str | Path) -> Path:
        """Write :meth:`to_dict` to *path* (parents created); returns the path."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return target

    def plot(self, path: str | Path, *, attack: str | None = None) -> Path:
        """Histogram of the scores of included vs excluded canaries, saved as a PNG.

        Raises:
            ConfigurationError: matplotlib is missing, or ``attack`` is not a score name.
        """
        try:
            import matplotlib

            matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError:
            raise ConfigurationError(
                "the audit plot needs matplotlib: pip install 'opake-auditing[plot]'"
            ) from None
        name = attack or self.attack
        if name not in self.scores:
            raise ConfigurationError(
                f"attack={name!r}: no such score vector; have {', '.join(self.scores) or 'none'}"
            )
        values = self.scores[name]
        inside = [s for s, flag in zip(values, self.included, strict=True) if flag]
        outside = [s for s, flag in zip(values, self.included, strict=True) if not flag]
        fig, ax = plt.subplots(figsize=(7, 4))
        lo, hi = min(values), max(values)
        bins = 40 if hi > lo else 1
        ax.hist(outside, bins=bins, range=(lo, hi or lo + 1), alpha=0.6, label="excluded (out)")
        ax.hist(inside, bins=bins, range=(lo, hi or lo + 1), alpha=0.6, label="included (in)")
        ax.set_xlabel(f"canary score ({name})")
        ax.set_ylabel("canaries")
        ax.set_title(
            f"claimed ε = {self.claimed_epsilon:.2f}, measured ε ≥ {self.epsilon_lower_bound:.2f} "
            f"({self.confidence:.0%}; {self.correct}/{self.guesses} correct)",
            fontsize=10,
        )
        ax.legend()
        fig.tight_layout()
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(target, dpi=100)
        plt.close(fig)
        return target
