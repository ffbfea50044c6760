"""The PLD options of the training front ends: one read-only constant, ε still an upper bound."""

from __future__ import annotations

import pytest

from opake.accounting import TRAINING_PLD_OPTIONS, epsilon


def test_training_options_are_read_only() -> None:
    with pytest.raises(TypeError):
        TRAINING_PLD_OPTIONS["value_discretization_interval"] = 1.0  # type: ignore[index]


def test_coarser_grid_never_reports_a_smaller_epsilon() -> None:
    schedule = {"noise_multiplier": 1.1, "sample_rate": 0.01, "steps": 500, "delta": 1e-5}
    fine = epsilon(accountant="pld", **schedule)
    coarse = epsilon(accountant="pld", accountant_options=dict(TRAINING_PLD_OPTIONS), **schedule)
    assert fine <= coarse <= fine * 1.01


def test_every_listed_accountant_is_built_by_make_accountant() -> None:
    from opake.accounting import ACCOUNTANTS, make_accountant
    from opake.accounting._accountant import _KINDS

    assert tuple(_KINDS) == ACCOUNTANTS
    for kind in ACCOUNTANTS:
        assert make_accountant(kind).kind == kind
