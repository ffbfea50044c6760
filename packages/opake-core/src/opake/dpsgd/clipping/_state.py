"""Clipping methods and their states (frozen, serialisable dataclasses).

Each class is both the configuration a user passes as ``clipped_grad(clipping_norm=...)`` and the
state ``grad_fn`` threads through training steps. Only :class:`AdaptiveClipping` changes from
step to step; the others are returned unchanged.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from opake.core.errors import ConfigurationError, InputTypeError

if TYPE_CHECKING:
    import torch

__all__ = [
    "AdaptiveClipping",
    "AdaptiveNoiseSplit",
    "AutoSClipping",
    "ClipState",
    "FixedClipping",
    "GroupClipping",
    "adaptive_noise_split",
    "clip_state_from_dict",
    "gradient_noise_multiplier",
]


def _positive(owner: str, name: str, value: object, *, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputTypeError(
            f"{owner}: {name}={value!r} is a {type(value).__name__}; expected a positive float"
        )
    value = float(value)
    if not (value > 0.0) or (math.isinf(value) and not allow_inf):
        raise ConfigurationError(
            f"{owner}: {name}={value!r}; expected a positive finite float (a clipping bound "
            "must be finite for the sensitivity, and so the privacy guarantee, to exist)"
        )
    return value


def _check_keys(
    owner: str, data: Mapping[str, Any], required: set[str], optional: set[str]
) -> None:
    if not isinstance(data, Mapping):
        raise InputTypeError(f"{owner}: expected a mapping (from to_dict()), got {type(data)}")
    missing = required - set(data)
    unknown = set(data) - required - optional - {"kind"}
    if missing or unknown:
        raise ConfigurationError(
            f"{owner}: missing keys {sorted(missing)} / unknown keys {sorted(unknown)}; pass a "
            "dict produced by to_dict() of the same class"
        )


@dataclass(frozen=True)
class FixedClipping:
    """Clip every example's gradient to L2 norm ``clipping_norm`` (C); sensitivity C.

    Each example's gradient ``g`` (all differentiated leaves together) is scaled by
    ``min(1, C / (‖g‖ + 1e-6))``.

    >>> FixedClipping(1.0).sensitivity
    1.0
    >>> FixedClipping.from_dict(FixedClipping(0.5).to_dict())
    FixedClipping(clipping_norm=0.5)
    """

    kind: ClassVar[str] = "fixed"
    clipping_norm: float

    def __post_init__(self) -> None:
        norm = _positive("FixedClipping", "clipping_norm", self.clipping_norm)
        object.__setattr__(self, "clipping_norm", norm)

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the clipped sum (before ``normalize_by``): C."""
        return self.clipping_norm

    def end_step(self, **_: Any) -> FixedClipping:
        """End a logical step: nothing to update, returns ``self``."""
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable form; :meth:`from_dict` reverses it."""
        return {"kind": self.kind, "clipping_norm": self.clipping_norm}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FixedClipping:
        """Rebuild from :meth:`to_dict` output."""
        _check_keys("FixedClipping.from_dict", data, {"clipping_norm"}, set())
        return cls(data["clipping_norm"])


@dataclass(frozen=True)
class GroupClipping:
    """Clip each parameter group separately: group k of an example's gradient to norm ``C_k``.

    The clipped per-example gradient then has norm at most ``sqrt(Σ_k C_k²)``, the combined
    sensitivity. Which parameters form a group is decided by ``clipped_grad(clipping_groups=...)``
    (by default a group name is a dotted prefix of parameter names; ``""`` matches every name).

    >>> state = GroupClipping({"encoder": 3.0, "head": 4.0})
    >>> state.sensitivity
    5.0
    >>> GroupClipping.from_dict(state.to_dict()) == state
    True
    """

    kind: ClassVar[str] = "group"
    clipping_norms: Mapping[str, float]

    def __post_init__(self) -> None:
        if not isinstance(self.clipping_norms, Mapping) or not self.clipping_norms:
            raise ConfigurationError(
                f"GroupClipping: clipping_norms={self.clipping_norms!r}; expected a non-empty "
                "mapping from group name to a positive float bound"
            )
        norms: dict[str, float] = {}
        for name, value in self.clipping_norms.items():
            if not isinstance(name, str):
                raise InputTypeError(
                    f"GroupClipping: group name {name!r} is a {type(name).__name__}; expected str"
                )
            norms[name] = _positive("GroupClipping", f"clipping_norms[{name!r}]", value)
        object.__setattr__(self, "clipping_norms", MappingProxyType(norms))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GroupClipping):
            return NotImplemented
        return dict(self.clipping_norms) == dict(other.clipping_norms)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.clipping_norms.items())))

    def __repr__(self) -> str:
        return f"GroupClipping(clipping_norms={dict(self.clipping_norms)!r})"

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the clipped sum: ``sqrt(Σ_k C_k²)``."""
        return math.sqrt(math.fsum(c * c for c in self.clipping_norms.values()))

    def end_step(self, **_: Any) -> GroupClipping:
        """End a logical step: nothing to update, returns ``self``."""
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable form; :meth:`from_dict` reverses it."""
        return {"kind": self.kind, "clipping_norms": dict(self.clipping_norms)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GroupClipping:
        """Rebuild from :meth:`to_dict` output."""
        _check_keys("GroupClipping.from_dict", data, {"clipping_norms"}, set())
        return cls(dict(data["clipping_norms"]))


@dataclass(frozen=True)
class AutoSClipping:
    """Automatic clipping AUTO-S (Bu et al., 2023): scale each gradient by ``R / (‖g‖ + γ)``.

    Every example is rescaled (there is no threshold to tune); its norm becomes
    ``R‖g‖/(‖g‖+γ) < R``, so the sensitivity is ``R`` (``clipping_norm``). ``stability`` is γ.

    >>> AutoSClipping(clipping_norm=1.0, stability=0.01).sensitivity
    1.0
    """

    kind: ClassVar[str] = "auto_s"
    clipping_norm: float = 1.0
    stability: float = 0.01

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "clipping_norm", _positive("AutoSClipping", "clipping_norm", self.clipping_norm)
        )
        object.__setattr__(
            self, "stability", _positive("AutoSClipping", "stability", self.stability)
        )

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the rescaled sum: R."""
        return self.clipping_norm

    def end_step(self, **_: Any) -> AutoSClipping:
        """End a logical step: nothing to update, returns ``self``."""
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable form; :meth:`from_dict` reverses it."""
        return {"kind": self.kind, "clipping_norm": self.clipping_norm, "stability": self.stability}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AutoSClipping:
        """Rebuild from :meth:`to_dict` output."""
        _check_keys("AutoSClipping.from_dict", data, {"clipping_norm", "stability"}, set())
        return cls(data["clipping_norm"], data["stability"])


@dataclass(frozen=True)
class AdaptiveClipping:
    """Adaptive quantile clipping (Andrew et al., 2021): C follows a target quantile of norms.

    Clipping itself is :class:`FixedClipping` with the current ``clipping_norm`` C (so the
    gradient's sensitivity is C). Each example also contributes ``b_i − ½`` to a count, where
    ``b_i = 1`` if its gradient norm was ≤ C (non-finite examples count as clipped, padding
    examples not at all). Once per logical step (:meth:`end_step`) the count gets Gaussian noise
    of standard deviation ``count_noise_multiplier`` (σ_b) and C is updated geometrically::

        b̃ = (Σ(b_i − ½) + N(0, σ_b²)) / expected_batch_size + ½
        C ← C · exp(−learning_rate · (b̃ − target_quantile))

    The count is a second Gaussian query on the same examples (sensitivity ½ thanks to the
    centring), so it costs privacy: a step whose gradient noise multiplier is σ_Δ is a Gaussian
    mechanism with multiplier ``σ = (σ_Δ⁻² + (2σ_b)⁻²)^-½``. Account the run with σ and add
    gradient noise with multiplier σ_Δ = ``gradient_noise_multiplier(σ,
    count_noise_multiplier=σ_b)`` (see :meth:`noise_split`); Andrew et al. suggest
    ``σ_b = expected_batch_size / 20``.

    ``seed=None`` draws the count noise from the OS entropy pool (``random.SystemRandom``);
    an integer seed makes it reproducible (derived from ``(seed, step)``). ``step`` counts
    completed logical steps; ``pending_count`` is the centred count accumulated in the current
    step (a tensor between physical batches, a float after :meth:`to_dict`).

    >>> state = AdaptiveClipping(1.0, count_noise_multiplier=0.8, expected_batch_size=16, seed=0)
    >>> state.sensitivity
    1.0
    >>> AdaptiveClipping.from_dict(state.to_dict()) == state
    True
    """

    kind: ClassVar[str] = "adaptive"
    clipping_norm: float
    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise_multiplier: float = field(kw_only=True)
    expected_batch_size: float = field(kw_only=True)
    seed: int | None = field(default=None, kw_only=True)
    step: int = field(default=0, kw_only=True)
    pending_count: float | torch.Tensor = field(default=0.0, kw_only=True, compare=False)

    def __post_init__(self) -> None:
        owner = "AdaptiveClipping"
        object.__setattr__(
            self, "clipping_norm", _positive(owner, "clipping_norm", self.clipping_norm)
        )
        object.__setattr__(
            self, "learning_rate", _positive(owner, "learning_rate", self.learning_rate)
        )
        object.__setattr__(
            self,
            "count_noise_multiplier",
            _positive(owner, "count_noise_multiplier", self.count_noise_multiplier),
        )
        object.__setattr__(
            self,
            "expected_batch_size",
            _positive(owner, "expected_batch_size", self.expected_batch_size),
        )
        quantile = self.target_quantile
        if isinstance(quantile, bool) or not isinstance(quantile, int | float):
            raise InputTypeError(f"{owner}: target_quantile={quantile!r}; expected a float")
        if not 0.0 < float(quantile) < 1.0:
            raise ConfigurationError(
                f"{owner}: target_quantile={quantile!r}; expected a float in (0, 1), e.g. 0.5 "
                "to clip at the median gradient norm"
            )
        object.__setattr__(self, "target_quantile", float(quantile))
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise InputTypeError(f"{owner}: seed={self.seed!r}; expected an int or None")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ConfigurationError(f"{owner}: step={self.step!r}; expected an int ≥ 0")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AdaptiveClipping):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.to_dict().items(), key=lambda kv: kv[0])))

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of this step's clipped sum: the current C."""
        return self.clipping_norm

    def noise_split(self, noise_multiplier: float) -> AdaptiveNoiseSplit:
        """:func:`adaptive_noise_split` of ``noise_multiplier`` with this state's σ_b."""
        return adaptive_noise_split(
            noise_multiplier, count_noise_multiplier=self.count_noise_multiplier
        )

    def add_count(self, centred_count: torch.Tensor | float) -> AdaptiveClipping:
        """Add ``Σ(b_i − ½)`` of one physical batch to the pending count (no device sync)."""
        return replace(self, pending_count=self.pending_count + centred_count)

    def end_step(
        self, *, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> AdaptiveClipping:
        """Close a logical step: noise the pending count once and update C geometrically.

        ``reduce`` (e.g. an all-reduce sum across data-parallel ranks) is applied to the pending
        count first; every rank must then draw the same noise, so give the state an integer
        ``seed`` shared by all ranks in distributed training. Costs one host sync.
        """
        import torch

        count = self.pending_count
        if not isinstance(count, torch.Tensor):
            count = torch.tensor(float(count), dtype=torch.float64)
        if reduce is not None:
            count = reduce(count)
        if self.seed is None:
            rng: random.Random = random.SystemRandom()
        else:
            rng = random.Random(f"opake.adaptive-clipping:{self.seed}:{self.step}")
        noise = rng.gauss(0.0, self.count_noise_multiplier)
        fraction = (float(count.item()) + noise) / self.expected_batch_size + 0.5
        new_norm = self.clipping_norm * math.exp(
            -self.learning_rate * (fraction - self.target_quantile)
        )
        return replace(self, clipping_norm=new_norm, step=self.step + 1, pending_count=0.0)

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable form (a pending tensor count becomes a float)."""
        pending = self.pending_count
        if not isinstance(pending, float | int):
            pending = float(pending.item())
        return {
            "kind": self.kind,
            "clipping_norm": self.clipping_norm,
            "target_quantile": self.target_quantile,
            "learning_rate": self.learning_rate,
            "count_noise_multiplier": self.count_noise_multiplier,
            "expected_batch_size": self.expected_batch_size,
            "seed": self.seed,
            "step": self.step,
            "pending_count": float(pending),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AdaptiveClipping:
        """Rebuild from :meth:`to_dict` output."""
        keys = {
            "clipping_norm",
            "target_quantile",
            "learning_rate",
            "count_noise_multiplier",
            "expected_batch_size",
            "seed",
            "step",
        }
        _check_keys("AdaptiveClipping.from_dict", data, keys, {"pending_count"})
        return cls(
            data["clipping_norm"],
            data["target_quantile"],
            data["learning_rate"],
            count_noise_multiplier=data["count_noise_multiplier"],
            expected_batch_size=data["expected_batch_size"],
            seed=data["seed"],
            step=data["step"],
            pending_count=float(data.get("pending_count", 0.0)),
        )


ClipState = FixedClipping | GroupClipping | AutoSClipping | AdaptiveClipping

_KINDS: dict[str, type[FixedClipping | GroupClipping | AutoSClipping | AdaptiveClipping]] = {
    cls.kind: cls for cls in (FixedClipping, GroupClipping, AutoSClipping, AdaptiveClipping)
}


def clip_state_from_dict(data: Mapping[str, Any]) -> ClipState:
    """Rebuild any clip state from its ``to_dict()`` form (dispatch on ``data["kind"]``).

    >>> clip_state_from_dict(AutoSClipping(2.0).to_dict())
    AutoSClipping(clipping_norm=2.0, stability=0.01)
    """
    kind = data.get("kind") if isinstance(data, Mapping) else None
    if kind not in _KINDS:
        raise ConfigurationError(
            f"clip_state_from_dict: kind={kind!r}; expected one of {sorted(_KINDS)} (a dict "
            "produced by a clip state's to_dict())"
        )
    return _KINDS[kind].from_dict(data)


@dataclass(frozen=True)
class AdaptiveNoiseSplit:
    """How adaptive clipping splits one step's privacy between the gradient and the count.

    Attributes:
        noise_multiplier: σ of the whole step, the value to give the accountant.
        gradient_noise_multiplier: σ_Δ, the multiplier for the gradient noise (std σ_Δ·C).
        count_noise_multiplier: σ_b, the standard deviation of the count noise.
        count_privacy_fraction: share of the step's privacy (zCDP ρ = 1/(2σ²), additive
            across the two queries) spent on the count: ``σ² / (2σ_b)²``.
    """

    noise_multiplier: float
    gradient_noise_multiplier: float
    count_noise_multiplier: float
    count_privacy_fraction: float


def gradient_noise_multiplier(noise_multiplier: float, *, count_noise_multiplier: float) -> float:
    """Gradient noise multiplier σ_Δ = (σ⁻² − (2σ_b)⁻²)^-½ that keeps a step at total σ.

    The same function as :func:`opake.accounting.gradient_noise_multiplier` (imported when
    called, so importing the clipping module stays cheap); see :func:`adaptive_noise_split`.

    >>> round(gradient_noise_multiplier(1.0, count_noise_multiplier=10.0), 6)
    1.001252
    """
    from opake.accounting import gradient_noise_multiplier as implementation

    return implementation(noise_multiplier, count_noise_multiplier=count_noise_multiplier)


def adaptive_noise_split(
    noise_multiplier: float, *, count_noise_multiplier: float
) -> AdaptiveNoiseSplit:
    """Split a step's total noise multiplier σ between the gradient and the adaptive count.

    Andrew et al. (2021), Theorem 1: releasing the clipped sum with multiplier σ_Δ and the
    centred count with noise σ_b is one Gaussian mechanism with multiplier
    ``σ = (σ_Δ⁻² + (2σ_b)⁻²)^-½``. Given the σ you account for (see :mod:`opake.accounting`),
    the gradient must therefore use ``σ_Δ = (σ⁻² − (2σ_b)⁻²)^-½``
    (:func:`gradient_noise_multiplier`), which exists only when ``2σ_b > σ``.

    >>> split = adaptive_noise_split(1.0, count_noise_multiplier=10.0)
    >>> round(split.gradient_noise_multiplier, 6), round(split.count_privacy_fraction, 4)
    (1.001252, 0.0025)
    """
    grad_sigma = gradient_noise_multiplier(
        noise_multiplier, count_noise_multiplier=count_noise_multiplier
    )
    sigma = float(noise_multiplier)
    sigma_b = float(count_noise_multiplier)
    return AdaptiveNoiseSplit(
        noise_multiplier=sigma,
        gradient_noise_multiplier=grad_sigma,
        count_noise_multiplier=sigma_b,
        count_privacy_fraction=sigma**2 / (2.0 * sigma_b) ** 2,
    )
