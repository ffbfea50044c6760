"""Privacy accountants: a history of DP-SGD phases, composed into ε(δ) or δ(ε)."""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from opake.accounting import _floor, _pld, _rdp
from opake.accounting._phase import Phase, _make_phase
from opake.accounting._validate import (
    check_delta,
    check_epsilon,
)
from opake.core.choices import ACCOUNTANTS
from opake.core.errors import ConfigurationError, InputTypeError, OperationError

__all__ = [
    "ACCOUNTANTS",
    "PLDAccountant",
    "PrivacyAccountant",
    "RDPAccountant",
    "accountant_from_state_dict",
    "make_accountant",
]

_STATE_VERSION = 1


class PrivacyAccountant(abc.ABC):
    """History of DP-SGD steps and the (ε, δ) they have spent.

    Subclasses implement the composition of the Poisson-subsampled Gaussian mechanism;
    the base class keeps the history, merges identical consecutive steps into phases, and adds
    the truncation term of fixed-shape sampling (see ``opake.accounting.truncation_probability``).

    Example:
        >>> acc = make_accountant("rdp")
        >>> acc.step(noise_multiplier=2.0, sample_rate=0.05, num_steps=10)
        >>> acc.step(noise_multiplier=1.5, sample_rate=0.05, num_steps=10)
        >>> [p.num_steps for p in acc.history], acc.steps
        ([10, 10], 20)
    """

    kind: ClassVar[str]

    def __init__(self) -> None:
        self._history: list[Phase] = []

    # -- recording --------------------------------------------------------------------------

    def step(
        self,
        *,
        noise_multiplier: float,
        sample_rate: float,
        num_steps: int = 1,
        count_noise_multiplier: float | None = None,
        max_batch_size: int | None = None,
        dataset_size: int | None = None,
    ) -> None:
        """Record ``num_steps`` DP-SGD steps with noise σ and Poisson rate q.

        Args:
            noise_multiplier: σ of the gradient noise.
            sample_rate: Poisson rate q of the global batch (expected batch size / N).
            num_steps: how many steps (0 records nothing).
            count_noise_multiplier: σ_b of adaptive clipping's noisy count (Andrew et al.);
                the step is then accounted at σ_eff = (σ⁻² + (2σ_b)⁻²)^(-1/2).
            max_batch_size: ``B_max`` of fixed-shape truncated Poisson sampling; with
                ``dataset_size`` the truncation probability is added to δ (union bound).
            dataset_size: N, the size of the dataset sampled from.
        """
        phase = _make_phase(
            noise_multiplier=noise_multiplier,
            sample_rate=sample_rate,
            num_steps=num_steps,
            count_noise_multiplier=count_noise_multiplier,
            max_batch_size=max_batch_size,
            dataset_size=dataset_size,
        )
        self._append(phase)

    def _append(self, phase: Phase) -> None:
        if phase.num_steps == 0:
            return
        if self._history and self._history[-1].same_mechanism(phase):
            last = self._history[-1]
            self._history[-1] = Phase(
                last.noise_multiplier,
                last.sample_rate,
                last.num_steps + phase.num_steps,
                last.count_noise_multiplier,
                last.max_batch_size,
                last.dataset_size,
            )
        else:
            self._history.append(phase)

    @property
    def history(self) -> tuple[Phase, ...]:
        """The recorded phases, oldest first (consecutive identical steps merged)."""
        return tuple(self._history)

    @property
    def steps(self) -> int:
        """Total number of steps recorded."""
        return sum(p.num_steps for p in self._history)

    @property
    def truncation_mass(self) -> float:
        """Σ over phases of steps × P(truncation): the TV distance to plain Poisson sampling."""
        return math.fsum(p.num_steps * p.truncation_probability for p in self._history)

    def reset(self) -> None:
        """Forget every recorded step."""
        self._history.clear()

    # -- queries ----------------------------------------------------------------------------

    def _groups(self) -> list[tuple[float, float, int]]:
        """(σ_eff, q, steps), one per distinct mechanism, in first-seen order."""
        groups: dict[tuple[float, float], int] = {}
        for phase in self._history:
            key = (phase.effective_noise_multiplier, phase.sample_rate)
            groups[key] = groups.get(key, 0) + phase.num_steps
        return [(sigma, q, steps) for (sigma, q), steps in groups.items()]

    @abc.abstractmethod
    def _poisson_epsilon(self, delta: float) -> float:
        """ε(δ) of the recorded steps under plain Poisson sampling (no truncation term)."""

    @abc.abstractmethod
    def _poisson_delta(self, epsilon: float) -> float:
        """δ(ε) of the recorded steps under plain Poisson sampling (no truncation term)."""

    def get_epsilon(self, delta: float) -> float:
        """Smallest ε such that the recorded steps are (ε, δ)-DP; ``inf`` when none is.

        With truncated sampling the result satisfies
        ``δ_Poisson(ε) + (1 + e^ε)·truncation_mass ≤ δ``.
        """
        delta = check_delta(delta)
        if not self._history:
            return 0.0
        mass = self.truncation_mass
        if mass == 0.0:
            return self._poisson_epsilon(delta)
        # Smallest fixed point of g(ε) = ε_Poisson(δ - (1 + e^ε)·mass): g is increasing, so
        # iterating from 0 climbs to it; the answer is then certified with get_delta.
        eps = 0.0
        for _ in range(100):
            budget = delta - (1.0 + math.exp(min(eps, 700.0))) * mass
            if budget <= 0.0:
                return math.inf
            new = self._poisson_epsilon(budget)
            if not math.isfinite(new):
                return math.inf
            converged = new - eps <= 1e-10 * max(1.0, new)
            eps = max(eps, new)
            if converged:
                break
        for bump in (0.0, 1e-10, 1e-8, 1e-6, 1e-4):
            candidate = eps * (1.0 + bump) + bump
            if self.get_delta(candidate) <= delta:
                return candidate
        raise OperationError(  # pragma: no cover - defensive: the fixed point always certifies
            f"could not certify ε for δ={delta} with truncation mass {mass}"
        )

    def get_delta(self, epsilon: float) -> float:
        """Smallest δ such that the recorded steps are (ε, δ)-DP."""
        epsilon = check_epsilon(epsilon)
        if not self._history:
            return 0.0
        slack = (1.0 + math.exp(min(epsilon, 700.0))) * self.truncation_mass
        return min(1.0, self._poisson_delta(epsilon) + slack)

    # -- state ------------------------------------------------------------------------------

    @abc.abstractmethod
    def options(self) -> dict[str, Any]:
        """Constructor options (JSON-serialisable)."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: kind, options and the full history."""
        return {
            "kind": self.kind,
            "version": _STATE_VERSION,
            "options": self.options(),
            "history": [p.to_dict() for p in self._history],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the history with the one in ``state`` (from :meth:`state_dict`)."""
        history = self.check_state_dict(state)
        self._history = []
        for phase in history:
            self._append(phase)

    def check_state_dict(self, state: Mapping[str, Any]) -> list[Phase]:
        """The history :meth:`load_state_dict` would restore; raises what it would refuse."""
        if not isinstance(state, Mapping):
            raise InputTypeError(f"state={type(state).__name__}: expected a mapping")
        for key in ("kind", "version", "options", "history"):
            if key not in state:
                raise ConfigurationError(
                    f"accountant state lacks {key!r}: pass an accountant's state_dict() output"
                )
        if state["kind"] != self.kind:
            raise ConfigurationError(
                f"accountant state of kind {state['kind']!r} loaded into a {self.kind!r} "
                "accountant; build it with opake.accounting.accountant_from_state_dict(state)"
            )
        if state["version"] != _STATE_VERSION:
            raise ConfigurationError(
                f"accountant state version {state['version']!r}: this Opake reads {_STATE_VERSION}"
            )
        options = dict(state["options"])
        if options != self.options():
            raise ConfigurationError(
                f"accountant state has options {options} but this accountant has "
                f"{self.options()}; build it with opake.accounting.accountant_from_state_dict"
            )
        return [Phase.from_dict(p) for p in state["history"]]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(steps={self.steps}, phases={len(self._history)})"


class RDPAccountant(PrivacyAccountant):
    """Rényi-DP accountant for the Poisson-subsampled Gaussian (Mironov et al. 2019).

    RDP adds up over steps at each order α; ε(δ) uses the improved conversion of Balle et
    al. 2020 / Canonne, Kamath, Steinke 2020. Cheap and an upper bound, typically 10–30 % above
    the PLD accountant's ε.

    Args:
        orders: the RDP orders α > 1 (default: ``DEFAULT_RDP_ORDERS``, as ``dp-accounting``).

    Example:
        >>> acc = RDPAccountant()
        >>> acc.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=1000)
        >>> round(acc.get_epsilon(1e-5), 3)
        2.101
    """

    kind = "rdp"

    def __init__(self, orders: Sequence[float] | None = None) -> None:
        super().__init__()
        if orders is None:
            self._orders = _rdp.DEFAULT_RDP_ORDERS
        else:
            try:
                values = tuple(float(a) for a in orders)
            except (TypeError, ValueError) as err:
                raise InputTypeError(f"orders={orders!r}: expected a sequence of floats") from err
            if not values or any(not (a > 1.0 and math.isfinite(a)) for a in values):
                raise ConfigurationError(
                    f"orders={orders!r}: expected a non-empty sequence of finite orders α > 1"
                )
            self._orders = values
        self._cache: dict[tuple[float, float], np.ndarray] = {}

    @property
    def orders(self) -> tuple[float, ...]:
        return self._orders

    def rdp(self) -> np.ndarray:
        """Total RDP ε(α) of the recorded steps at each order."""
        total = np.zeros(len(self._orders))
        for sigma, q, steps in self._groups():
            key = (sigma, q)
            if key not in self._cache:
                if len(self._cache) > 64:
                    self._cache.clear()
                self._cache[key] = _rdp.subsampled_gaussian_rdp(q, sigma, self._orders)
            total += steps * self._cache[key]
        return total

    def _poisson_epsilon(self, delta: float) -> float:
        return _rdp.epsilon_from_rdp(self._orders, self.rdp(), delta)[0]

    def _poisson_delta(self, epsilon: float) -> float:
        return _rdp.delta_from_rdp(self._orders, self.rdp(), epsilon)[0]

    def options(self) -> dict[str, Any]:
        if self._orders == _rdp.DEFAULT_RDP_ORDERS:
            return {"orders": None}
        return {"orders": list(self._orders)}


class PLDAccountant(PrivacyAccountant):
    """Privacy-loss-distribution accountant: tight (ε, δ) for the subsampled Gaussian.

    Both worst-case directions of add/remove adjacency are discretised pessimistically on a
    grid of ``value_discretization_interval`` nats and composed by FFT; ε(δ) is the larger of
    the two. The discretisation is pessimistic, so the result bounds the true ε from above up
    to the FFT's rounding, which is why δ below :meth:`delta_floor` (at least 1e-10) is
    answered by the RDP bound of the same steps instead (``docs/guide/privacy.md``).

    Args:
        value_discretization_interval: grid step Δ of the privacy loss (default 1e-4, as
            ``dp-accounting``; 1e-3 is ~10× faster and, with ``"connect_dots"``, usually within
            0.5 % of it).
        discretization: ``"connect_dots"`` (default, tight) or ``"round_up"`` (privacy
            buckets; its bias grows with the number of steps).

    Example:
        >>> acc = PLDAccountant(value_discretization_interval=1e-3)
        >>> acc.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=1000)
        >>> round(acc.get_epsilon(1e-5), 2)
        1.83
    """

    kind = "pld"

    def __init__(
        self,
        value_discretization_interval: float = 1e-4,
        discretization: _pld.Discretization = "connect_dots",
    ) -> None:
        super().__init__()
        if isinstance(value_discretization_interval, bool) or not isinstance(
            value_discretization_interval, int | float
        ):
            raise InputTypeError(
                f"value_discretization_interval={value_discretization_interval!r}: expected a float"
            )
        interval = float(value_discretization_interval)
        if not 0.0 < interval <= 0.1:
            raise ConfigurationError(
                f"value_discretization_interval={value_discretization_interval!r}: expected a "
                "grid step in (0, 0.1] nats (1e-4 is accurate, 1e-3 fast)"
            )
        if discretization not in ("connect_dots", "round_up"):
            raise ConfigurationError(
                f"discretization={discretization!r}: expected 'connect_dots' or 'round_up'"
            )
        self._interval = interval
        self._discretization: _pld.Discretization = discretization
        self._single: dict[tuple[float, float, str], _pld.DiscretePLD] = {}
        self._composed: tuple[tuple[tuple[float, float, int], ...], list[_pld.DiscretePLD]] | None
        self._composed = None

    @property
    def value_discretization_interval(self) -> float:
        return self._interval

    def _single_step(self, sigma: float, q: float, direction: str) -> _pld.DiscretePLD:
        key = (sigma, q, direction)
        if key not in self._single:
            if len(self._single) > 16:
                self._single.clear()
            self._single[key] = _pld.subsampled_gaussian_pld(
                sigma,
                q,
                self._interval,
                "remove" if direction == "remove" else "add",
                self._discretization,
            )
        return self._single[key]

    def _plds(self) -> list[_pld.DiscretePLD]:
        groups = tuple(self._groups())
        if self._composed is not None and self._composed[0] == groups:
            return self._composed[1]
        symmetric = all(q == 1.0 for _, q, _ in groups)
        directions = ("remove",) if symmetric else ("remove", "add")
        plds = []
        for direction in directions:
            parts = [
                self._single_step(sigma, q, direction).self_compose(steps)
                for sigma, q, steps in groups
            ]
            plds.append(_pld.compose_all(parts, self._interval))
        self._composed = (groups, plds)
        return plds

    def delta_floor(self) -> float:
        """The smallest δ answered from the PLD itself; below it ε(δ) is the RDP bound of the
        same steps, never below the PLD's ε at this floor (:mod:`opake.accounting._floor`:
        the FFT composition's rounding can exceed a smaller δ)."""
        if not self._history:
            return _floor.PLD_DELTA_FLOOR
        return _floor.delta_floor(max(pld.rounding for pld in self._plds()))

    def _poisson_epsilon(self, delta: float) -> float:
        floor = self.delta_floor()
        at = max(delta, floor)
        eps = max(pld.epsilon_for_delta(at) for pld in self._plds())
        if delta >= floor:
            return eps
        return max(eps, _floor.rdp_epsilon(self._groups(), delta, floor))

    def _poisson_delta(self, epsilon: float) -> float:
        delta = max(pld.delta_for_epsilon(epsilon) for pld in self._plds())
        floor = self.delta_floor()
        if delta >= floor:
            return delta
        return min(floor, max(delta, _floor.rdp_delta(self._groups(), epsilon)))

    def options(self) -> dict[str, Any]:
        return {
            "value_discretization_interval": self._interval,
            "discretization": self._discretization,
        }


#: one class per name of :data:`opake.core.choices.ACCOUNTANTS` (a test checks they agree)
_KINDS: dict[str, type[PrivacyAccountant]] = {"pld": PLDAccountant, "rdp": RDPAccountant}


def make_accountant(kind: str = "pld", **options: Any) -> PrivacyAccountant:
    """Build an accountant by name: ``"pld"`` (default) or ``"rdp"``, with its options.

    Example:
        >>> make_accountant("rdp")
        RDPAccountant(steps=0, phases=0)
    """
    if not isinstance(kind, str) or kind.lower() not in _KINDS:
        raise ConfigurationError(
            f"accountant={kind!r}: expected one of {sorted(_KINDS)} ('pld' is tight, 'rdp' fast)"
        )
    return _KINDS[kind.lower()](**options)


def accountant_from_state_dict(state: Mapping[str, Any]) -> PrivacyAccountant:
    """Rebuild an accountant (kind, options and history) from its :meth:`state_dict`.

    Example:
        >>> acc = make_accountant("rdp")
        >>> acc.step(noise_multiplier=1.1, sample_rate=0.01, num_steps=10)
        >>> accountant_from_state_dict(acc.state_dict()).steps
        10
    """
    if not isinstance(state, Mapping):
        raise InputTypeError(f"state={type(state).__name__}: expected a mapping")
    if state.get("kind") not in _KINDS:
        raise ConfigurationError(
            f"accountant state of kind {state.get('kind')!r}: expected one of {sorted(_KINDS)}"
        )
    options = state.get("options")
    if not isinstance(options, Mapping):
        raise ConfigurationError("accountant state lacks its 'options' mapping")
    accountant = make_accountant(str(state["kind"]), **dict(options))
    accountant.load_state_dict(state)
    return accountant
