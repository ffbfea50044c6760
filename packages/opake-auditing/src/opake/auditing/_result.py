"""The result of an audit: claimed ε, the measured lower bound, the guesses, and a plot."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opake.core.errors import ConfigurationError

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

    def summary(self) -> str:
        """One line: claimed ε vs the measured lower bound."""
        verdict = (
            "consistent with the claim"
            if self.consistent
            else "VIOLATION: the measured lower bound exceeds the claimed ε"
        )
        engine = f" through the {self.engine} engine" if self.engine else ""
        group = "" if self.group == "all" else f" on the {self.group} canaries"
        return (
            f"claimed ε = {self.claimed_epsilon:.3f}, measured lower bound ε ≥ "
            f"{self.epsilon_lower_bound:.3f} at δ = {self.delta:.3g} with {self.confidence:.0%} "
            f"confidence ({self.correct}/{self.guesses} correct guesses on {self.canaries} "
            f"{self.kind} canaries{engine}, attack {self.attack}{group}): {verdict}"
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
