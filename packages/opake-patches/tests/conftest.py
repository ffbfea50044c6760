"""Shared fixtures: runtime patches applied per test and always removed, tiny HF models."""

from __future__ import annotations

import warnings

import pytest
import torch

from opake.core import plugins
from opake.patches import remove_runtime_patches
from opake.patches.runtime import apply_runtime_patches


@pytest.fixture(autouse=True)
def _no_leftover_runtime_patches():
    """Every test starts and ends with stock torch (the patches are process-global)."""
    remove_runtime_patches()
    yield
    remove_runtime_patches()


@pytest.fixture
def patched():
    """Runtime patches installed for the duration of one test."""
    state = apply_runtime_patches()
    yield state
    remove_runtime_patches()


@pytest.fixture
def fresh_plugins(monkeypatch):
    """A plugin manager without entry points (families are registered by the test)."""
    monkeypatch.setenv("OPAKE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("OPAKE_KERNEL_BACKEND", raising=False)
    plugins.reset_plugins()
    yield
    plugins.reset_plugins()


def _llama_config(**overrides):
    from transformers import LlamaConfig

    kwargs = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32,
        "use_cache": False,
        "attn_implementation": "eager",
    }
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


@pytest.fixture
def tiny_llama():
    """Factory: a 2-layer Llama (hidden 32, vocab 64) built from a config, seeded."""

    def make(seed: int = 0, **overrides):
        from transformers import LlamaForCausalLM

        torch.manual_seed(seed)
        model = LlamaForCausalLM(_llama_config(**overrides))
        model.train()
        return model

    return make


def enable_hf_checkpointing(model) -> None:
    """``gradient_checkpointing_enable()`` without transformers' deprecation noise."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()


@pytest.fixture
def hf_checkpointing():
    return enable_hf_checkpointing
