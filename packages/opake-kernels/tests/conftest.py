"""opake-kernels tests.

Triton reads ``TRITON_INTERPRET`` when its kernels are defined (module import), so it is set here,
before anything imports ``opake.kernels.triton``: without a GPU the Triton backend runs in the
interpreter on CPU tensors (tiny shapes only: it is 600-4000x slower than eager PyTorch).
"""

from __future__ import annotations

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch as _torch

    os.environ["TRITON_INTERPRET"] = "0" if _torch.cuda.is_available() else "1"

import pytest
import torch

from opake.core.plugins import reset_plugins


def _triton_device() -> str:
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


#: backend name -> device its tests run on (triton: cpu under the interpreter, else cuda)
DEVICES = {"torch": "cpu", "chunked": "cpu", "triton": _triton_device()}


@pytest.fixture(autouse=True)
def _fresh_plugins():
    """Rediscover plugins per test (selection depends on the environment at discovery)."""
    reset_plugins()
    yield
    reset_plugins()


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def devices() -> dict[str, str]:
    """Backend name -> the device its tests run on."""
    return dict(DEVICES)
