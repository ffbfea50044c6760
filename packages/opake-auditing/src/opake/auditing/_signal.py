"""What one gradient canary goes through in DP-SGD, and the scores of a correct run, simulated.

In a DP-SGD step an included canary is drawn with probability q (Poisson sampling), its
gradient is clipped to norm C and joins the sum, and Gaussian noise of standard deviation σ·C
is added once. Projected on the canary's direction, in units of C, step t gives
``x_t = B_t + σ·Z_t`` with ``B_t ~ Bernoulli(q)`` for an included canary (0 for an excluded
one) and ``Z_t ~ N(0, 1)``, independently over the T steps. A run that exactly meets the claim
its accountant computes from (σ, q, T) gives the canaries nothing more than this;
:meth:`SubsampledGaussian.scores` simulates it, with the same attacks as
:meth:`~opake.auditing.CanaryRun.scores`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError, InputTypeError

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

__all__ = ["ATTACKS", "SubsampledGaussian", "likelihood_ratio"]

#: the attacks on gradient canaries (see :meth:`opake.auditing.CanaryRun.scores`)
ATTACKS = ("all_steps", "likelihood_ratio", "replayed_steps")
#: simulated projections held in memory at once (steps × canaries)
_CHUNK = 1 << 21


def likelihood_ratio(
    table: NDArray[np.floating[Any]], *, noise_multiplier: float, sample_rate: float
) -> NDArray[np.floating[Any]]:
    """``Σ_t log(1 − q + q·exp((x_t − ½)/σ²))`` over the rows of ``table`` (``[T, m]``
    projections in units of C): the log likelihood ratio of "included" for one canary of the
    Poisson-subsampled Gaussian mechanism, the most powerful test (Neyman–Pearson).

    Example:
        >>> import numpy as np
        >>> float(likelihood_ratio(np.array([[0.5]]), noise_multiplier=1.0, sample_rate=1.0)[0])
        0.0
    """
    import numpy as np

    sigma, q = noise_multiplier, sample_rate
    # annotated: numpy types a reduction over an axis as Any
    if q >= 1.0:
        ratio: NDArray[np.floating[Any]] = ((table - 0.5) / sigma**2).sum(axis=0)
        return ratio
    mixed = np.logaddexp(math.log1p(-q), math.log(q) + (table - 0.5) / sigma**2)
    subsampled: NDArray[np.floating[Any]] = mixed.sum(axis=0)
    return subsampled


def _number(name: str, value: object, *, upper: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputTypeError(f"{name}={value!r} ({type(value).__name__}): expected a number")
    if not (0 < value <= upper and math.isfinite(value)):
        limit = "in (0, 1]" if upper == 1.0 else "> 0 and finite"
        raise ConfigurationError(f"{name}={value!r}: expected a number {limit}")
    return float(value)


@dataclass(frozen=True)
class SubsampledGaussian:
    """The mechanism a gradient canary goes through in T steps of DP-SGD: drawn with
    probability ``sample_rate`` per step, clipped to C, Gaussian noise ``noise_multiplier``·C.

    Attributes:
        noise_multiplier: σ.
        sample_rate: q, the Poisson sampling rate.
        steps: T, the logical DP steps.

    Example:
        >>> mechanism = SubsampledGaussian(noise_multiplier=0.96, sample_rate=0.0195, steps=20)
        >>> round(mechanism.draws, 2)  # an included canary is in 0.39 batches on average
        0.39
    """

    noise_multiplier: float
    sample_rate: float
    steps: int

    def __post_init__(self) -> None:
        _number("noise_multiplier", self.noise_multiplier)
        _number("sample_rate", self.sample_rate, upper=1.0)
        steps = self.steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigurationError(f"steps={steps!r}: expected an int >= 1")

    @property
    def draws(self) -> float:
        """q·T: in how many batches an included canary is on average."""
        return self.sample_rate * self.steps

    def scores(
        self, included: Sequence[bool] | Any, attacks: Sequence[str], rng: np.random.Generator
    ) -> dict[str, np.ndarray]:
        """Each canary's score per attack in a simulated correct run (see the module).

        ``"all_steps"``, ``"likelihood_ratio"`` and ``"replayed_steps"`` (over the steps of a
        replay independent of the run, as a correct sampler gives) are scored as
        :meth:`~opake.auditing.CanaryRun.scores` scores them; any other attack name gets the
        likelihood ratio, the most powerful test (an upper reference for that attack).

        Example:
            >>> import numpy as np
            >>> mechanism = SubsampledGaussian(noise_multiplier=1.0, sample_rate=0.5, steps=4)
            >>> scores = mechanism.scores([True, False], ["all_steps"], np.random.default_rng(0))
            >>> scores["all_steps"].shape
            (2,)
        """
        import numpy as np

        truth = np.asarray(included, dtype=bool).reshape(-1)
        m = int(truth.shape[0])
        names = list(dict.fromkeys(str(a) for a in attacks))
        sigma, q = self.noise_multiplier, self.sample_rate
        out = {name: np.zeros(m) for name in names}
        chunk = max(1, _CHUNK // max(1, m))
        for start in range(0, self.steps, chunk):
            t = min(chunk, self.steps - start)
            drawn = (rng.random((t, m)) < q) & truth
            table = drawn + sigma * rng.standard_normal((t, m))
            replay = rng.random((t, m)) < q if "replayed_steps" in names else None
            for name in names:
                if name == "all_steps":
                    out[name] += table.sum(axis=0)
                elif name == "replayed_steps" and replay is not None:
                    out[name] += np.where(replay, table, 0.0).sum(axis=0)
                else:
                    out[name] += likelihood_ratio(table, noise_multiplier=sigma, sample_rate=q)
        return out
