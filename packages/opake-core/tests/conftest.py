"""Shared fixtures for opake-core tests: tiny models (from configs) and their batches.

The builders and the per-example-loop oracle live in :mod:`opake.core.testing` so other
distributions reuse them; these fixtures only pick sizes that keep the suite fast.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from opake.core import testing

VOCAB = 128
SEQ = 8


@pytest.fixture
def mlp() -> torch.nn.Module:
    return testing.tiny_mlp(in_features=8, hidden=16, classes=4, seed=0)


@pytest.fixture
def mlp_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(10, 8, generator=gen) * torch.linspace(0.1, 6.0, 10)[:, None]
    y = torch.randint(0, 4, (10,), generator=gen)
    return x, y


@pytest.fixture
def token_batch() -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    return torch.randint(0, VOCAB, (4, SEQ), generator=gen)


@pytest.fixture
def tiny_llama() -> torch.nn.Module:
    pytest.importorskip("transformers")
    return testing.tiny_llama(hidden_size=32, num_hidden_layers=2, vocab_size=VOCAB)


@pytest.fixture
def tiny_gpt2() -> torch.nn.Module:
    pytest.importorskip("transformers")
    return testing.tiny_gpt2(n_embd=32, n_layer=2, vocab_size=VOCAB)


@pytest.fixture
def flush_denormal():
    """Flush-to-zero and denormals-are-zero on for the test (the clipping proof must hold with
    them); skipped on a CPU that cannot flush denormals."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals (torch.set_flush_denormal returned False)")
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


@pytest.fixture(scope="session")
def ranks_launcher() -> ModuleType:
    """:mod:`_ranks` beside this file: start test workers as torchrun would."""
    spec = importlib.util.spec_from_file_location(
        "opake_test_ranks", Path(__file__).with_name("_ranks.py")
    )
    assert spec is not None
    assert spec.loader is not None
    module = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fresh_dynamo():
    """A test that traces from scratch (with or without opake-patches' runtime patches, which
    other tests of the suite may have installed: compiled transforms trace either way). Use
    with ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
