"""opake-models tests: tiny models built from each family's ``tiny_config`` (no download).

``TRITON_INTERPRET`` is set before anything imports ``opake.kernels.triton`` (Triton reads it
when its kernels are defined) so the Triton backend runs on CPU tensors in the interpreter.
"""

from __future__ import annotations

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch as _torch

    os.environ["TRITON_INTERPRET"] = "0" if _torch.cuda.is_available() else "1"

import pytest
import torch

from opake.core import plugins


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models are dominated by threading overhead: one intra-op thread is ~10-40x faster
    on the shared 2-core machines (restored after each test)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_plugins(monkeypatch):
    """Each test discovers plugins anew, with no backend forced from the environment."""
    monkeypatch.delenv("OPAKE_KERNEL_BACKEND", raising=False)
    plugins.reset_plugins()
    yield
    plugins.reset_plugins()
