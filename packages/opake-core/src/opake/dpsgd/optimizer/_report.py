"""What one logical DP step did: :class:`StepReport` (see :mod:`opake.dpsgd.optimizer`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["StepReport"]


@dataclass(frozen=True)
class StepReport:
    """What one logical DP step did.

    Attributes:
        step: number of logical steps taken so far, this one included.
        noise_multiplier: σ used for this step.
        sensitivity: L2 sensitivity of the summed clipped gradient (the ``max_norm`` carried by
            the gradients, the largest one if physical batches disagreed).
        noise_std: standard deviation of the Gaussian noise added to the *sum*, ``σ·sensitivity``.
            The averaged gradient in ``.grad`` carries ``noise_std / expected_batch_size``.
        expected_batch_size: the divisor applied after noise (``q·N`` for Poisson sampling).
        sample_rate: the sampling rate recorded in the accountant (``None`` without accountant).
        physical_batches: how many physical batches were accumulated into this step.
        epsilon: ε spent so far at ``delta`` (only when an accountant and ``delta`` were given).
        delta: the δ ``epsilon`` refers to.
        skipped_params: optimizer parameters that received no gradient entry at all and were
            therefore not updated (neither gradient nor noise).
        aux: the per-physical-batch ``aux`` objects returned by the gradient function in
            :meth:`DPOptimizer.logical_step` (diagnostics: **not** private).
    """

    step: int
    noise_multiplier: float
    sensitivity: float
    noise_std: float
    expected_batch_size: float
    sample_rate: float | None
    physical_batches: int
    epsilon: float | None = None
    delta: float | None = None
    skipped_params: tuple[str, ...] = ()
    aux: tuple[Any, ...] = ()
