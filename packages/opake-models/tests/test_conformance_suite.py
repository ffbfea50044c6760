"""The conformance suite's own behaviour (its checks on real families run in test_families.py)."""

from __future__ import annotations

import pytest
import torch

from opake.core.errors import ConfigurationError, InputTypeError
from opake.models.testing import (
    CHECKS,
    ConformanceCase,
    ConformanceError,
    run_check,
    run_family_conformance,
    tiny_model,
)


def test_case_validation():
    with pytest.raises(InputTypeError, match="zero-argument callable"):
        ConformanceCase("llama")
    with pytest.raises(ConfigurationError, match="batch=1"):
        ConformanceCase(lambda: None, batch=1)
    with pytest.raises(ConfigurationError, match="rtol"):
        ConformanceCase(lambda: None, rtol=0.0)


def test_unknown_check_names_raise():
    case = ConformanceCase(lambda: tiny_model("llama"))
    with pytest.raises(ConfigurationError, match="unknown conformance check 'nope'"):
        run_check("nope", case)
    with pytest.raises(ConfigurationError, match=r"unknown conformance checks \['nope'\]"):
        run_family_conformance(lambda: tiny_model("llama"), checks=["nope"])


def test_registered_check_fails_for_a_model_type_nobody_claims():
    run_check("registered", ConformanceCase(lambda: tiny_model("llama")))
    model = tiny_model("llama")
    model.config.model_type = "not_a_family"
    with pytest.raises(ConformanceError, match="no installed model family claims"):
        run_check("registered", ConformanceCase(lambda: model))


def test_factory_must_be_deterministic():
    seeds = iter(range(100))
    case = ConformanceCase(lambda: tiny_model("llama", seed=next(seeds)))
    with pytest.raises(ConformanceError, match="different weights on two calls"):
        run_check("outputs_match", case)


def test_non_module_factory_is_rejected():
    with pytest.raises(InputTypeError, match=r"expected a torch\.nn\.Module"):
        run_check("outputs_match", ConformanceCase(lambda: torch.zeros(1)))


def test_every_check_is_documented():
    for name, check in CHECKS.items():
        assert check.__doc__, name
