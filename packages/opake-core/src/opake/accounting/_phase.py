"""One phase of a DP-SGD run: ``num_steps`` identical steps (rate, noise, sampling options)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opake.accounting._adaptive import effective_noise_multiplier
from opake.accounting._truncation import truncation_probability
from opake.accounting._validate import (
    check_noise_multiplier,
    check_positive_int,
    check_sample_rate,
    check_steps,
)
from opake.core.errors import ConfigurationError, InputTypeError

__all__ = ["Phase"]


@dataclass(frozen=True)
class Phase:
    """``num_steps`` identical DP-SGD steps: Poisson rate, noise, and the options that change
    what one step costs.

    Attributes:
        noise_multiplier: σ of the gradient noise (noise std / sensitivity).
        sample_rate: Poisson rate q of the *global* batch.
        num_steps: how many such steps.
        count_noise_multiplier: σ_b of adaptive clipping's noisy count (``None``: fixed C).
        max_batch_size: ``B_max`` of fixed-shape truncated Poisson sampling (``None``: plain).
        dataset_size: N, needed with ``max_batch_size`` for the truncation probability.

    Example:
        >>> phase = Phase(noise_multiplier=1.0, sample_rate=0.01, num_steps=100,
        ...               count_noise_multiplier=10.0)
        >>> round(phase.effective_noise_multiplier, 4), phase.truncation_probability
        (0.9988, 0.0)
    """

    noise_multiplier: float
    sample_rate: float
    num_steps: int
    count_noise_multiplier: float | None = None
    max_batch_size: int | None = None
    dataset_size: int | None = None

    @property
    def effective_noise_multiplier(self) -> float:
        """σ the accountant composes: σ, or (σ⁻² + (2σ_b)⁻²)^(-1/2) with adaptive clipping."""
        if self.count_noise_multiplier is None:
            return self.noise_multiplier
        return effective_noise_multiplier(
            self.noise_multiplier, count_noise_multiplier=self.count_noise_multiplier
        )

    @property
    def truncation_probability(self) -> float:
        """Per-step P(batch > B_max) on the larger neighbour (0 without truncation)."""
        if self.max_batch_size is None or self.dataset_size is None:
            return 0.0
        return truncation_probability(
            dataset_size=self.dataset_size,
            sample_rate=self.sample_rate,
            max_batch_size=self.max_batch_size,
        )

    def same_mechanism(self, other: Phase) -> bool:
        return (
            self.noise_multiplier == other.noise_multiplier
            and self.sample_rate == other.sample_rate
            and self.count_noise_multiplier == other.count_noise_multiplier
            and self.max_batch_size == other.max_batch_size
            and self.dataset_size == other.dataset_size
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "num_steps": self.num_steps,
            "count_noise_multiplier": self.count_noise_multiplier,
            "max_batch_size": self.max_batch_size,
            "dataset_size": self.dataset_size,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Phase:
        if not isinstance(data, Mapping):
            raise InputTypeError(f"phase={data!r}: expected a mapping from Phase.to_dict()")
        try:
            return _make_phase(
                noise_multiplier=data["noise_multiplier"],
                sample_rate=data["sample_rate"],
                num_steps=data["num_steps"],
                count_noise_multiplier=data.get("count_noise_multiplier"),
                max_batch_size=data.get("max_batch_size"),
                dataset_size=data.get("dataset_size"),
            )
        except KeyError as err:
            raise ConfigurationError(
                f"phase {dict(data)!r} lacks {err.args[0]!r}: pass Phase.to_dict()'s output"
            ) from err


def _make_phase(
    *,
    noise_multiplier: object,
    sample_rate: object,
    num_steps: object,
    count_noise_multiplier: object = None,
    max_batch_size: object = None,
    dataset_size: object = None,
) -> Phase:
    sigma = check_noise_multiplier(noise_multiplier)
    q = check_sample_rate(sample_rate)
    steps = check_steps(num_steps)
    sigma_b = (
        None
        if count_noise_multiplier is None
        else check_noise_multiplier(count_noise_multiplier, "count_noise_multiplier")
    )
    if (max_batch_size is None) != (dataset_size is None):
        raise ConfigurationError(
            f"max_batch_size={max_batch_size!r}, dataset_size={dataset_size!r}: fixed-shape "
            "(truncated) Poisson sampling needs both, to bound P(batch > max_batch_size); plain "
            "Poisson sampling needs neither"
        )
    b_max = None if max_batch_size is None else check_positive_int(max_batch_size, "max_batch_size")
    n = None if dataset_size is None else check_positive_int(dataset_size, "dataset_size")
    return Phase(sigma, q, steps, sigma_b, b_max, n)
