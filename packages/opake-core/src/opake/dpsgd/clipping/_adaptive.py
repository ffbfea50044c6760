"""Adaptive quantile clipping and how its count query splits a step's privacy."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

from opake.core.errors import ConfigurationError, InputTypeError
from opake.dpsgd.clipping._base import (
    EPS,
    ChunkNorms,
    ClipFactors,
    ClipState,
    check_keys,
    positive,
    whole_gradient_factors,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "AdaptiveClipping",
    "AdaptiveNoiseSplit",
    "adaptive_noise_split",
    "gradient_noise_multiplier",
]


@dataclass(frozen=True)
class AdaptiveClipping(ClipState):
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

    The count noise is the ``unit_noise`` :meth:`end_step` is given, times σ_b: ``DPTraining``
    and ``DistributedDPOptimizer.logical_step`` pass ``DPOptimizer.count_noise(step)``, drawn
    from the run's random source (secure unless the run is seeded; with several ranks drawn
    once and shared). Without it — ``DPOptimizer.logical_step``, or a ``grad_fn`` told
    ``end_step=True`` — the OS entropy pool (``random.SystemRandom``). An integer ``seed``
    makes it reproducible and **not private** (derived from ``(seed, step)``: whoever knows
    the seed recovers each step's exact count from the clipping norms), so a run with secure
    noise refuses it. ``step`` counts
    completed logical steps; ``pending_count`` is the centred count accumulated in the current
    step (a tensor between physical batches, a float after :meth:`to_dict`).

    >>> state = AdaptiveClipping(1.0, count_noise_multiplier=0.8, expected_batch_size=16, seed=0)
    >>> state.sensitivity
    1.0
    >>> AdaptiveClipping.from_dict(state.to_dict()) == state
    True
    """

    kind: ClassVar[str] = "adaptive"
    evolving: ClassVar[frozenset[str]] = frozenset({"clipping_norm", "step", "pending_count"})
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
            self, "clipping_norm", positive(owner, "clipping_norm", self.clipping_norm)
        )
        object.__setattr__(
            self, "learning_rate", positive(owner, "learning_rate", self.learning_rate)
        )
        object.__setattr__(
            self,
            "count_noise_multiplier",
            positive(owner, "count_noise_multiplier", self.count_noise_multiplier),
        )
        object.__setattr__(
            self,
            "expected_batch_size",
            positive(owner, "expected_batch_size", self.expected_batch_size),
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

    def factors(self, norms: ChunkNorms) -> ClipFactors:
        """Fixed clipping at the current C, plus this chunk's centred count ``Σ(b_i − ½)``."""
        import torch

        bound = norms.bound
        below = (bound <= self.clipping_norm) & norms.finite
        count = torch.where(norms.is_real, below.double() - 0.5, 0.0).sum()
        factor = (self.clipping_norm / (bound + EPS)).clamp(max=1.0)
        return whole_gradient_factors(norms, factor, count=count)

    def advance(self, count: torch.Tensor, *, end_step: bool) -> AdaptiveClipping:
        """Add the call's count; at the end of a logical step, noise it and update C."""
        state = self.add_count(count)
        return state.end_step() if end_step else state

    def noise_split(self, noise_multiplier: float) -> AdaptiveNoiseSplit:
        """:func:`adaptive_noise_split` of ``noise_multiplier`` with this state's σ_b."""
        return adaptive_noise_split(
            noise_multiplier, count_noise_multiplier=self.count_noise_multiplier
        )

    def add_count(self, centred_count: torch.Tensor | float) -> AdaptiveClipping:
        """Add ``Σ(b_i − ½)`` of one physical batch to the pending count (no device sync)."""
        return replace(self, pending_count=self.pending_count + centred_count)

    def end_step(
        self,
        *,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        unit_noise: float | None = None,
    ) -> AdaptiveClipping:
        """Close a logical step: noise the pending count once and update C geometrically.

        ``reduce`` (e.g. an all-reduce sum across data-parallel ranks) is applied to the pending
        count first; every rank must then add the same noise: pass ``unit_noise``, one
        standard normal value every rank holds (``opt.count_noise(state.step)`` of a
        distributed optimizer: drawn once, broadcast). Costs one host sync.
        """
        import torch

        count = self.pending_count
        if not isinstance(count, torch.Tensor):
            count = torch.tensor(float(count), dtype=torch.float64)
        if reduce is not None:
            count = reduce(count)
        if self.seed is not None:  # explicit and reproducible: not private
            if unit_noise is not None:
                raise ConfigurationError(
                    f"AdaptiveClipping(seed={self.seed}).end_step(unit_noise=...): the count "
                    "noise comes from the seed; pass one or the other"
                )
            rng = random.Random(f"opake.adaptive-clipping:{self.seed}:{self.step}")
            noise = rng.gauss(0.0, self.count_noise_multiplier)
        elif unit_noise is not None:
            noise = float(unit_noise) * self.count_noise_multiplier
        else:
            noise = random.SystemRandom().gauss(0.0, self.count_noise_multiplier)
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
        check_keys("AdaptiveClipping.from_dict", data, keys, {"pending_count"})
        return cls(
            data["clipping_norm"],
            data["target_quantile"],
            data["learning_rate"],
            count_noise_multiplier=data["count_noise_multiplier"],
            expected_batch_size=data["expected_batch_size"],
            seed=data["seed"],
            step=data["step"],
            pending_count=_pending(data.get("pending_count", 0.0)),
        )


def _pending(value: Any) -> float:
    """A saved pending count: a finite number (NaN or ∞ would make the next bound NaN after
    the step was accounted)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigurationError(
            f"AdaptiveClipping pending_count={value!r}: expected a finite number (the state of "
            "to_dict())"
        )
    return float(value)


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
