"""Empirical privacy auditing of DP-SGD in one training run.

A proof of (ε, δ) covers the mechanism as designed; an audit measures the mechanism as built.
Canaries — gradient directions (white-box) or inserted examples (black-box) — are each
included with probability ½; after one training run each canary is scored, the top scores are
guessed "in" and the bottom ones "out", and the number of correct guesses becomes a lower
bound on ε at a chosen confidence (Steinke, Nasr & Jagielski, NeurIPS 2023). A lower bound
above the claimed ε proves the claim wrong; one below it proves nothing more than that this
audit found no violation. See ``docs/guide/auditing.md``.

- :func:`epsilon_lower_bound`, :func:`p_value` — the bound itself;
- :func:`one_run_audit` — guesses from scores → :class:`AuditResult`;
- :class:`GradientCanaries` / :class:`CanaryRun` — white-box canaries through the run's clipping
  engine and the DP optimizer, plain and crafted against book-keeping's numerics
  (:data:`CRAFTED_KINDS`);
- :class:`InputCanaries`, :func:`random_token_canaries` — black-box canaries;
- :func:`audit` — audit your own training function;
- :func:`self_test` — audit opake-core's DP-SGD on a small model, through the engine a run uses;
- :func:`simulate_gaussian_audit` — the audit of an ideal Gaussian mechanism (resolution);
- :func:`max_provable_bound`, :func:`expected_lower_bound` (of a run that exactly meets its
  claim: :class:`SubsampledGaussian`, the run's σ, q and T), :func:`canaries_needed` — what an
  audit can show; :class:`AuditResult` carries them (``max_provable``,
  ``expected_if_correct``, ``advice``: :class:`Advice`) and :meth:`AuditResult.explain` says them.

>>> from opake.auditing import epsilon_lower_bound
>>> round(epsilon_lower_bound(canaries=1000, guesses=200, correct=200, delta=1e-5), 2)
4.17
"""

from __future__ import annotations

from opake.auditing._api import audit
from opake.auditing._bound import EPSILON_CEILING, epsilon_lower_bound, p_value
from opake.auditing._canaries import (
    CANARY_ENGINES,
    CANARY_PARAMETER,
    CRAFTED_KINDS,
    CanaryRun,
    GradientCanaries,
    step_quietly,
)
from opake.auditing._input import InputCanaries, random_token_canaries
from opake.auditing._onerun import (
    GROUP_GUESS_FRACTION,
    GUESS_FRACTIONS,
    draw_inclusion,
    one_run_audit,
)
from opake.auditing._resolution import (
    Advice,
    canaries_needed,
    expected_lower_bound,
    max_provable_bound,
)
from opake.auditing._result import AuditResult
from opake.auditing._selftest import REPLAY_SEED, replay_batches, self_test
from opake.auditing._signal import SubsampledGaussian
from opake.auditing._simulate import simulate_gaussian_audit

__all__ = [
    "CANARY_ENGINES",
    "CANARY_PARAMETER",
    "CRAFTED_KINDS",
    "EPSILON_CEILING",
    "GROUP_GUESS_FRACTION",
    "GUESS_FRACTIONS",
    "REPLAY_SEED",
    "Advice",
    "AuditResult",
    "CanaryRun",
    "GradientCanaries",
    "InputCanaries",
    "SubsampledGaussian",
    "audit",
    "canaries_needed",
    "draw_inclusion",
    "epsilon_lower_bound",
    "expected_lower_bound",
    "max_provable_bound",
    "one_run_audit",
    "p_value",
    "random_token_canaries",
    "replay_batches",
    "self_test",
    "simulate_gaussian_audit",
    "step_quietly",
]
