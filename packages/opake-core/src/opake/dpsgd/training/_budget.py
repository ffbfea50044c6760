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
            return low  # 2⁴⁰ steps checked; later ones are searched again once those are spent
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
    """A target ε and the logical step it ends at, computed once per ``(σ, q)`` and per
    accountant history outside the run (steps another run recorded into a shared accountant).

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
        self,
        steps: int,
        key: tuple[Any, ...],
        epsilon_after: Callable[[int], float],
        history: int | None = None,
    ) -> int | None:
        """Steps the budget allows after ``steps`` (``None``: no target); ``key`` names the
        current ``(σ, q)``, ``epsilon_after(k)`` is ε after ``k`` more steps, ``history`` the
        steps the accountant holds (when it holds others than this run's, the end is computed
        again: a shared accountant's other steps count against the same target)."""
        if self.target is None:
            return None
        key = (*key, None if history is None else history - steps)
        if key != self._key or self._end is None:
            self._key = key
            guess = (self.planned or 0) - steps
            self._end = steps + _steps_within(epsilon_after, guess, self.target)
        return max(0, self._end - steps)


class Spending:
    """What a run has spent and may still spend: ε from its accountant (cached per step and
    δ), the steps its :class:`Budget` still allows at the current ``(σ, q)``, and the refusal
    of a step past it. ``accounting``: the keywords each step is recorded with besides σ.

    >>> from opake.accounting import make_accountant
    >>> spending = Spending(make_accountant("rdp"), {"sample_rate": 0.01}, 1e-5, Budget(2.0, None))
    >>> spending.epsilon(0), spending.steps_left(0, 1.0, 0.01) > 100
    (0.0, True)
    """

    def __init__(
        self, accountant: Any, accounting: Mapping[str, Any], delta: float, budget: Budget
    ) -> None:
        self.accountant = accountant
        self.accounting = accounting
        self.delta = delta
        self.budget = budget
        self._cache: tuple[int, float, float] | None = None

    def reset(self) -> None:
        """Forget what was computed (a loaded state, or σ or q changed)."""
        self.budget.reset()
        self._cache = None

    def epsilon(self, steps: int, delta: float | None = None) -> float:
        """ε of everything the accountant recorded (``steps`` of them this run's; a shared
        accountant holds others' too) at ``delta`` (default: the run's δ), cached per
        recorded history."""
        d = self.delta if delta is None else delta
        recorded = int(self.accountant.steps)
        if self._cache is not None and self._cache[:2] == (recorded, d):
            return self._cache[2]
        value = float(self.accountant.get_epsilon(d)) if recorded else 0.0
        self._cache = (recorded, d, value)
        return value

    def steps_left(self, steps: int, sigma: float, rate: float) -> int | None:
        """Logical steps the budget still allows at ``(σ, q)`` (``None``: no target)."""

        def after(extra_steps: int) -> float:
            return _trial_epsilon(self.accountant, sigma, extra_steps, self.accounting, self.delta)

        history = int(self.accountant.steps)
        return self.budget.steps_left(steps, (sigma, rate), after, history)

    def check(self, steps: int, sigma: float, rate: float) -> None:
        """Raise :class:`PrivacyBudgetExhausted` when the budget allows no further step."""
        if self.steps_left(steps, sigma, rate) == 0:
            target = self.budget.target
            assert target is not None
            spent = (self.epsilon(steps), self.delta)
            raise exhausted(steps, spent, sigma, rate, target)
