"""Noise accounting of adaptive (quantile) clipping, Andrew et al. 2021.

Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with
Adaptive Clipping", NeurIPS 2021) releases, besides the noisy gradient sum (noise σ·C), a noisy
count of the examples whose norm was at most C, used to move C towards a target quantile. Each
example contributes ``b_i - 1/2`` with ``b_i ∈ {0, 1}``, so the count's sensitivity is 1/2, and
noise ``N(0, σ_b²)`` is added to it. Their Theorem 1: the pair is exactly the Gaussian
mechanism with noise multiplier

    σ_eff = (σ⁻² + (2σ_b)⁻²)^(-1/2),

which is what the accountant composes. Conversely, to spend the privacy of a target σ_eff
while releasing the count, the gradient noise must be raised to

    σ = (σ_eff⁻² - (2σ_b)⁻²)^(-1/2),     which needs 2σ_b > σ_eff.

The factor 2 holds only for the centred count (sensitivity 1/2); an implementation that adds
noise to the raw count Σ b_i (sensitivity 1) must pass ``count_noise_multiplier = σ_b / 2``.
``opake.dpsgd.clipping`` exposes the same formula for the training side.
"""

from __future__ import annotations

import math

from opake.accounting._validate import check_noise_multiplier
from opake.core.errors import ConfigurationError

__all__ = ["effective_noise_multiplier", "gradient_noise_multiplier"]


def effective_noise_multiplier(noise_multiplier: float, *, count_noise_multiplier: float) -> float:
    """σ_eff = (σ⁻² + (2σ_b)⁻²)^(-1/2): what one adaptive-clipping step costs, as one Gaussian.

    Example:
        >>> round(effective_noise_multiplier(1.0, count_noise_multiplier=10.0), 6)
        0.998752
    """
    sigma = check_noise_multiplier(noise_multiplier)
    sigma_b = check_noise_multiplier(count_noise_multiplier, "count_noise_multiplier")
    return 1.0 / math.sqrt(sigma**-2 + (2.0 * sigma_b) ** -2)


def gradient_noise_multiplier(noise_multiplier: float, *, count_noise_multiplier: float) -> float:
    """σ = (σ_eff⁻² - (2σ_b)⁻²)^(-1/2): gradient noise that, with the count, costs σ_eff.

    Example:
        >>> round(gradient_noise_multiplier(0.998752, count_noise_multiplier=10.0), 4)
        1.0
    """
    sigma_eff = check_noise_multiplier(noise_multiplier)
    sigma_b = check_noise_multiplier(count_noise_multiplier, "count_noise_multiplier")
    if 2.0 * sigma_b <= sigma_eff:
        raise ConfigurationError(
            f"count_noise_multiplier={sigma_b!r} with noise_multiplier={sigma_eff!r}: the count "
            f"alone already costs more than σ_eff allows (needs 2σ_b > σ_eff, i.e. σ_b > "
            f"{sigma_eff / 2:.6g}); raise count_noise_multiplier (Andrew et al. suggest "
            "σ_b ≈ expected batch size / 20)"
        )
    return 1.0 / math.sqrt(sigma_eff**-2 - (2.0 * sigma_b) ** -2)
