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


class _CppFlags:
    """The floating-point flags of every C++ build Inductor ran (see ``unsafe_inductor``)."""

    def __init__(self) -> None:
        self.builds: list[list[str]] = []

    def check(self) -> None:
        """Every build ran without unsafe math and without floating-point contraction."""
        assert self.builds, "no C++ code was built"
        for flags in self.builds:
            assert "fno-unsafe-math-optimizations" in flags, flags
            assert flags.index("fno-unsafe-math-optimizations") > flags.index(
                "funsafe-math-optimizations"
            ), flags
            assert "ffp-contract=off" in flags, flags
            assert "ffp-contract=fast" not in flags, flags


@pytest.fixture
def unsafe_inductor(monkeypatch):
    """Inductor configured as ``TORCHINDUCTOR_CPP_ENABLE_UNSAFE_MATH_OPT_FLAG=1`` and
    ``TORCHINDUCTOR_CPP_ENABLE_FLOATING_POINT_CONTRACT_FLAG=fast`` would (caches off, so the C++
    code is built in the test); yields a :class:`_CppFlags` recording every build's flags."""
    import warnings

    import torch._inductor.config as inductor
    import torch._inductor.cpp_builder as builder

    record = _CppFlags()
    original = builder._get_ffast_math_flags

    def spy() -> list[str]:
        flags = original()
        record.builds.append(list(flags))
        return flags

    monkeypatch.setattr(builder, "_get_ffast_math_flags", spy)
    unsafe = {
        "cpp.enable_unsafe_math_opt_flag": True,
        "cpp.enable_floating_point_contract_flag": "fast",
        "force_disable_caches": True,
    }
    with inductor.patch(unsafe), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "dynamo_pgo force disabled", UserWarning)
        yield record
