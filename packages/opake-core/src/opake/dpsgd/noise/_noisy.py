"""The result of a noise draw: the noised sums and the noise that was used."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["NoisyGrads"]


class NoisyGrads(dict[str, "torch.Tensor"]):
    """``name -> tensor`` dict of noised gradient sums, with the noise actually used.

    Attributes:
        noise_multiplier: σ of this draw.
        sensitivity: the L2 sensitivity S the noise was calibrated to.
        noise_std: ``σ·S``, the standard deviation of the noise added to every coordinate.
        secure: whether the draw came from a secure (operating-system) key, not a seed.
    """

    noise_multiplier: float
    sensitivity: float
    noise_std: float
    secure: bool

    def __init__(
        self,
        values: Mapping[str, torch.Tensor],
        *,
        noise_multiplier: float,
        sensitivity: float,
        secure: bool,
    ) -> None:
        super().__init__(values)
        self.noise_multiplier = noise_multiplier
        self.sensitivity = sensitivity
        self.noise_std = noise_multiplier * sensitivity
        self.secure = secure

    def __reduce__(
        self,
    ) -> tuple[Callable[..., NoisyGrads], tuple[dict[str, torch.Tensor], float, float, bool]]:
        return (
            _rebuild_noisy,
            (dict(self), self.noise_multiplier, self.sensitivity, self.secure),
        )


def _rebuild_noisy(
    values: dict[str, torch.Tensor], noise_multiplier: float, sensitivity: float, secure: bool
) -> NoisyGrads:
    return NoisyGrads(
        values, noise_multiplier=noise_multiplier, sensitivity=sensitivity, secure=secure
    )
