"""Privacy accounting for DP-SGD: ε(δ) for a schedule, and σ for a target ε.

Two accountants compose the Poisson-subsampled Gaussian mechanism under add/remove-one
adjacency:

* :class:`PLDAccountant` (default) — privacy loss distributions, pessimistically discretised
  and composed by FFT: tight;
* :class:`RDPAccountant` — Rényi DP (Mironov et al. 2019) with the improved RDP → (ε, δ)
  conversion: fast, somewhat looser.

Both record a history of phases (``step(noise_multiplier=, sample_rate=, num_steps=)``: σ and q
may change between phases), serialise it with ``state_dict()`` (JSON), and account for adaptive
clipping's count noise (``count_noise_multiplier=``) and for fixed-shape truncated Poisson
sampling (``max_batch_size=``, ``dataset_size=``). Neither depends on Google's
``dp-accounting``; Opake's tests check both against it. See ``docs/guide/privacy.md``.

Example:
    >>> from opake import accounting
    >>> fast = {"value_discretization_interval": 1e-3}
    >>> eps = accounting.epsilon(sample_rate=0.01, noise_multiplier=1.0, steps=1000,
    ...                          delta=1e-5, accountant_options=fast)
    >>> round(eps, 2)
    1.83
    >>> acc = accounting.PLDAccountant(value_discretization_interval=1e-3)
    >>> acc.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=500)
    >>> acc.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=500)  # merged into one phase
    >>> len(acc.history), acc.steps, round(acc.get_epsilon(1e-5), 2)
    (1, 1000, 1.83)
"""

from __future__ import annotations

from opake.accounting._accountant import (
    ACCOUNTANTS,
    PLDAccountant,
    PrivacyAccountant,
    RDPAccountant,
    accountant_from_state_dict,
    make_accountant,
)
from opake.accounting._adaptive import effective_noise_multiplier, gradient_noise_multiplier
from opake.accounting._api import (
    CALIBRATION_RANGE,
    TRAINING_PLD_OPTIONS,
    calibrate_noise,
    epsilon,
)
from opake.accounting._phase import Phase
from opake.accounting._rdp import DEFAULT_RDP_ORDERS
from opake.accounting._truncation import (
    fixed_shape_slots,
    max_batch_size_for,
    truncation_budget_for,
    truncation_probability,
)

__all__ = [
    "ACCOUNTANTS",
    "CALIBRATION_RANGE",
    "DEFAULT_RDP_ORDERS",
    "TRAINING_PLD_OPTIONS",
    "PLDAccountant",
    "Phase",
    "PrivacyAccountant",
    "RDPAccountant",
    "accountant_from_state_dict",
    "calibrate_noise",
    "effective_noise_multiplier",
    "epsilon",
    "fixed_shape_slots",
    "gradient_noise_multiplier",
    "make_accountant",
    "max_batch_size_for",
    "truncation_budget_for",
    "truncation_probability",
]
