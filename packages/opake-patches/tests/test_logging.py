"""Every automatic patch choice and fallback is logged on ``opake.patches``; op names come from
the contract module ``opake.core.ops``."""

from __future__ import annotations

import logging

import pytest
import torch

from opake.core import ops, plugins
from opake.core.errors import ConfigurationError
from opake.core.plugins import ModelFamily, hookimpl
from opake.patches import FamilyResult, HFCompat, LossOnlyHead, apply_model_patches
from opake.patches.hf import _loss_only
from opake.patches.model._options import check_kernels

pytest.importorskip("transformers")


class _Families:
    @hookimpl
    def opake_model_families(self):
        return [ModelFamily("toyllama", ("llama",), apply=_apply)]


def _apply(model, options):
    result = FamilyResult(hf=HFCompat("causal", LossOnlyHead()))
    result.skipped["rms_norm"] = "toy family swaps no kernels"
    return result


@pytest.fixture
def with_kernels(fresh_plugins):
    kernels_plugin = pytest.importorskip("opake.kernels._plugin")
    plugins.register_plugin(kernels_plugin, "opake-kernels")
    plugins.register_plugin(_Families(), "toy-families")


def _messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "opake.patches"]


def test_the_choices_of_one_patching_are_logged(with_kernels, tiny_llama, caplog):
    caplog.set_level(logging.INFO, logger="opake.patches")
    report = apply_model_patches(tiny_llama())
    logged = "\n".join(_messages(caplog))
    assert "runtime patches were not installed" in logged
    assert "family 'toyllama'" in logged
    backend = report.kernels[ops.LINEAR_CROSS_ENTROPY].backend
    assert f"kernel 'linear_cross_entropy': backend {backend!r}" in logged
    assert "rms_norm not applied: toy family swaps no kernels" in logged


def test_a_turned_off_automatic_choice_falls_back_to_the_reference_loudly(
    with_kernels, tiny_llama, caplog
):
    caplog.set_level(logging.INFO, logger="opake.patches")
    report = apply_model_patches(tiny_llama(), chunked_linear_cross_entropy=False)
    assert report.kernels[ops.LINEAR_CROSS_ENTROPY].backend == "torch"
    assert any(
        "turned off by chunked_linear_cross_entropy=False; the torch reference" in m
        for m in _messages(caplog)
    )


def test_no_loss_kernel_at_all_is_logged(fresh_plugins, tiny_llama, caplog):
    plugins.register_plugin(_Families(), "toy-families")  # and no kernel backend
    caplog.set_level(logging.INFO, logger="opake.patches")
    report = apply_model_patches(tiny_llama())
    assert "loss_only" in report.skipped
    assert any("loss-only forward off" in m for m in _messages(caplog))
    assert any(m.startswith("loss_only not applied") for m in _messages(caplog))


def test_the_recorded_loss_falls_back_to_the_selection_loudly(with_kernels, monkeypatch, caplog):
    monkeypatch.setattr(_loss_only, "_reported", set())
    caplog.set_level(logging.INFO, logger="opake.patches")
    kernel = _loss_only.LossKernel("torch", lambda *a, **k: None, True, "test")
    impl = _loss_only._recorded_impl(kernel, torch.device("cpu"))
    assert impl.__module__.startswith("opake.kernels.chunked")
    said = [m for m in _messages(caplog) if "loss backend 'torch' has no such op" in m]
    assert len(said) == 1
    assert "backend 'chunked' runs it (automatic" in said[0]


def test_patches_use_the_contract_names(with_kernels):
    assert check_kernels({ops.RMS_NORM: "torch"})[ops.RMS_NORM] == "torch"
    with pytest.raises(ConfigurationError, match="unknown op 'rms_nrom'"):
        check_kernels({"rms_nrom": "torch"})
