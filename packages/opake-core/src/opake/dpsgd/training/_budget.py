"""How many more logical steps fit in a privacy budget (``DPTraining``'s ``steps_left``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opake.dpsgd.training._result import PrivacyBudgetExhausted


def _steps_within(epsilon_after: Callable[[int], float], guess: int, target: float) -> int:
    """Largest k ≥ 0 with ``epsilon_after(k) ≤ target`` (exponential + binary search).

    ``epsilon_after(k)`` is ε after the history plus ``k`` more steps (non-decreasing in k);
    ``guess`` is the planned steps left (≤ 0: no plan), checked first.

    Example:
        >>> _steps_within(lambda k: 0.5 * k, guess=0, target=3.2)
        6
    """
    if guess > 0 and epsilon_after(guess) <= target:
        # σ calibrated for the planned run: usually exactly the planned steps fit
        if epsilon_after(guess + 1) > target:
            return guess
        low, high = guess + 1, 2 * guess + 2
    elif epsilon_after(1) > target:
        return 0
    else:
        low, high = 1, 2
    while epsilon_after(high) <= target:
        low, high = high, high * 2
        if high > 1 << 40:
            return high
    while high - low > 1:
        mid = (low + high) // 2
        if epsilon_after(mid) <= target:
            low = mid
        else:
            high = mid
    return low


def _trial_epsilon(
    accountant: Any,
    noise_multiplier: float,
    extra_steps: int,
    accounting: Mapping[str, Any],
    delta: float,
) -> float:
    """ε at ``delta`` after ``extra_steps`` more steps, on a copy of the accountant."""
    from opake.accounting import accountant_from_state_dict

    trial = accountant_from_state_dict(accountant.state_dict())
    trial.step(noise_multiplier=noise_multiplier, num_steps=extra_steps, **accounting)
    return float(trial.get_epsilon(delta))


def exhausted(
    steps: int, spent: tuple[float, float], sigma: float, rate: float, target: float
) -> PrivacyBudgetExhausted:
    """The error a step past the budget raises: ``spent`` is ``(ε so far, δ)``.

    >>> str(exhausted(3, (1.0, 1e-5), 1.1, 0.01, 1.0)).startswith("privacy budget spent")
    True
    """
    from opake.dpsgd.training._result import PrivacyBudgetExhausted

    epsilon, delta = spent
    return PrivacyBudgetExhausted(
        f"privacy budget spent: after {steps} step(s) ε = {epsilon:.4g} (δ = {delta:.3g}), and "
        f"one more step at σ = {sigma:.4g}, q = {rate:.4g} would exceed target_epsilon = "
        f"{target:g}. Stop training here (the model trained so far is (ε, δ)-DP), or raise the "
        "target knowingly"
    )


class Budget:
    """A target ε and the logical step it ends at, computed once per ``(σ, q)``.

    >>> budget = Budget(target=3.2, planned=None)
    >>> budget.steps_left(2, ("σ", "q"), lambda k: 0.5 * (2 + k))
    4
    >>> Budget(target=None, planned=None).steps_left(0, (), lambda k: 0.0) is None
    True
    """

    def __init__(self, target: float | None, planned: int | None) -> None:
        self.target = target
        self.planned = planned
        self._key: tuple[Any, ...] | None = None
        self._end: int | None = None

    @classmethod
    def checked(cls, target_epsilon: object, steps: object) -> Budget:
        """From ``DPTraining``'s ``target_epsilon`` and ``steps`` as given (each ``None`` or
        positive; a bad value raises)."""
        from opake.dpsgd.training._options import _optional_positive

        target = _optional_positive("target_epsilon", target_epsilon)
        return cls(target, _optional_positive("steps", steps, integer=True))

    def reset(self) -> None:
        """Forget the computed end (a loaded state, or σ or q changed)."""
        self._key = self._end = None

    def steps_left(
        self, steps: int, key: tuple[Any, ...], epsilon_after: Callable[[int], float]
    ) -> int | None:
        """Steps the budget allows after ``steps`` (``None``: no target); ``key`` names the
        current ``(σ, q)``, ``epsilon_after(k)`` is ε after ``k`` more steps."""
        if self.target is None:
            return None
        if key != self._key or self._end is None:
            self._key = key
            guess = (self.planned or 0) - steps
            self._end = steps + _steps_within(epsilon_after, guess, self.target)
        return max(0, self._end - steps)
