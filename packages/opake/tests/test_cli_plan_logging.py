"""``--kernels auto`` logs the model family it chose for the model type, or why the model runs
unpatched, on the ``opake.cli`` logger (the same words as the run's notes)."""

from __future__ import annotations

import logging

import torch

from opake.cli import _plan


def _auto(model_type: str | None, caplog) -> tuple[bool, list[str], list[str]]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="opake.cli"):
        patch, notes = _plan._check_kernels("auto", torch.device("cpu"), model_type)
    return patch, notes, [r.getMessage() for r in caplog.records if r.name == "opake.cli"]


def test_family_choice_and_unpatched_fallback_are_logged(caplog):
    patch, notes, logged = _auto("llama", caplog)
    assert (patch, notes) == (True, [])
    assert logged == ["--kernels auto: model_type 'llama' -> model family llama"]

    patch, notes, logged = _auto("no_such_model_type", caplog)
    assert patch is False
    assert notes[0].startswith("no Opake model family for model_type 'no_such_model_type'")
    assert logged == [f"--kernels auto: {notes[0]}"]


def test_kernels_none_is_no_automatic_choice(caplog):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="opake.cli"):
        assert _plan._check_kernels("none", torch.device("cpu"), "llama") == (False, [])
    assert not [r for r in caplog.records if r.name == "opake.cli"]
