"""Every automatic family choice is logged on ``opake.models``: the family matched, the kernel
backends chosen, the parts applied and every part skipped with its reason."""

from __future__ import annotations

import logging

import pytest

from opake.models import apply_family, family_spec
from opake.models.testing import tiny_model
from opake.patches import PatchOptions


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "opake.models"]


def test_family_match_kernels_and_skips_are_logged(caplog):
    model = tiny_model("llama", hidden_act="gelu")  # a gated kernel does not apply: skipped
    with caplog.at_level(logging.INFO, logger="opake.models"):
        report = apply_family(family_spec("llama"), model, PatchOptions(kernels="torch"))
    messages = _messages(caplog)
    assert messages[0] == "family 'llama' for LlamaForCausalLM (model_type 'llama', causal_lm)"
    assert f"family 'llama': applied {report.applied[0]}" in messages
    backend, reason = report.kernels["rms_norm"]
    assert f"family 'llama': kernel 'rms_norm' -> backend '{backend}' ({reason})" in messages
    assert f"family 'llama': mlp not applied: {report.skipped['mlp']}" in messages
    assert f"family 'llama': rope not applied: {report.skipped['rope']}" in messages
    assert len(messages) == 1 + len(report.applied) + len(report.kernels) + len(report.skipped)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="opake.models"):
        assert apply_family(family_spec("llama"), model) is report
    assert _messages(caplog) == ["family 'llama': LlamaForCausalLM is already patched"]
    report.undo()


def test_kernels_turned_off_are_logged_as_skipped(caplog):
    model = tiny_model("llama")
    with caplog.at_level(logging.INFO, logger="opake.models"):
        apply_family(family_spec("llama"), model, PatchOptions(performance=False)).undo()
    assert "family 'llama': kernels not applied: performance=False" in _messages(caplog)
