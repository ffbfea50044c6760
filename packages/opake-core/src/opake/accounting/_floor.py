"""Where the PLD accountant's floating-point δ stops being trusted, and what answers below it.

The PLD accountant discretises the privacy loss pessimistically, then composes by FFT in fp64.
The FFTs round: every computed mass carries an absolute error of about 10⁻¹⁸–10⁻¹⁵, and δ(ε)
sums up to millions of them. Against an exact oracle (q = 1, where k steps compose into one
Gaussian mechanism of noise multiplier σ/√k) the computed δ fell short of the true δ by up to
5·10⁻¹⁴ (σ = 200, 20 000 steps): harmless at δ = 10⁻⁵, but at δ = 10⁻¹⁴ the reported ε was the
ε of δ = 2.2·10⁻¹⁴, 1.4 % too small. A worst-case bound of that error (the FFT's normwise
rounding bound, propagated through k-fold powers and summed over the window) comes out of
order 10⁻⁹ and more: too large to use.

So the PLD's own answer is used only for δ at or above :func:`delta_floor`: the larger of
:data:`PLD_DELTA_FLOOR` and 100 times the computation's own rounding estimate
(:attr:`~opake.accounting._pld.DiscretePLD.rounding`, which was 10⁻¹³–5·10⁻¹¹ for 10² to 10⁵
steps, 100× and more above the shortfalls measured). Below it the accountant answers with the
RDP bound of the same steps — an upper bound that is computed in log space from closed forms,
without cancellation — and never below the PLD's ε at the floor, so ε(δ) stays monotone.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from opake.accounting import _rdp

__all__ = ["PLD_DELTA_FLOOR", "delta_floor", "rdp_delta", "rdp_epsilon"]

#: the smallest δ the PLD accountant answers from its own FFT composition
PLD_DELTA_FLOOR = 1e-10
#: the margin between the computation's rounding estimate and the δ it answers
_MARGIN = 100.0

_LOG = logging.getLogger("opake.core")
_REPORTED: set[float] = set()


def delta_floor(rounding: float) -> float:
    """The smallest δ whose ε the PLD answers itself, given its rounding estimate.

    >>> delta_floor(0.0), delta_floor(1e-10)
    (1e-10, 1e-08)
    """
    return max(PLD_DELTA_FLOOR, _MARGIN * rounding)


def _total(groups: Sequence[tuple[float, float, int]]) -> np.ndarray:
    orders = _rdp.DEFAULT_RDP_ORDERS
    total = np.zeros(len(orders))
    for sigma, q, steps in groups:
        total += steps * _rdp.subsampled_gaussian_rdp(q, sigma, orders)
    return total


def rdp_epsilon(groups: Sequence[tuple[float, float, int]], delta: float, floor: float) -> float:
    """ε(δ) of ``groups`` (``(σ, q, steps)``) by the RDP bound, for a δ below the PLD's floor.

    >>> round(rdp_epsilon([(1.0, 1.0, 1)], 1e-14, 1e-10), 2)  # one Gaussian step, σ = 1
    8.13
    """
    if floor not in _REPORTED:
        _REPORTED.add(floor)
        _LOG.info(
            "PLD accountant: δ = %g lies below %g, where the FFT composition's rounding may "
            "matter; ε comes from the RDP bound of the same steps",
            delta,
            floor,
        )
    return float(_rdp.epsilon_from_rdp(_rdp.DEFAULT_RDP_ORDERS, _total(groups), delta)[0])


def rdp_delta(groups: Sequence[tuple[float, float, int]], epsilon: float) -> float:
    """δ(ε) of ``groups`` by the RDP bound.

    >>> rdp_delta([(1.0, 1.0, 1)], 8.14) < 1e-14
    True
    """
    return float(_rdp.delta_from_rdp(_rdp.DEFAULT_RDP_ORDERS, _total(groups), epsilon)[0])
