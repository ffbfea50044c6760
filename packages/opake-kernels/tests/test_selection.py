"""Backend registration and selection: explicit > OPAKE_KERNEL_BACKEND > automatic > torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from opake.core import ops
from opake.core.errors import ConfigurationError, OperationError
from opake.core.plugins import KernelBackend, hookimpl, kernel_backends, register_plugin
from opake.kernels import _triton_support as support
from opake.kernels import kernel_choice, linear_cross_entropy, rms_norm


def test_three_backends_are_registered_with_every_op():
    backends = kernel_backends()
    for name in ("torch", "triton"):
        assert set(backends[name].ops) == {*ops.MODEL_OPS, ops.CLIP_ACCUMULATE}
    assert set(backends["chunked"].ops) == {
        *ops.MODEL_OPS,
        ops.LINEAR_CROSS_ENTROPY_EXAMPLE_GRADS,
        ops.LINEAR_CROSS_ENTROPY_RECORDED,
        ops.CLIP_ACCUMULATE,
    }
    assert backends["chunked"].priority > backends["torch"].priority
    assert "cpu" in backends["chunked"].devices
    assert "mps" in backends["chunked"].devices


def test_triton_is_registered_for_the_cpu_only_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert support.triton_devices() == ("cuda", "cpu")
    assert support.triton_priority() < kernel_backends()["torch"].priority
    assert support.triton_available()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert support.triton_devices() == ("cuda",)
    assert support.triton_priority() > kernel_backends()["chunked"].priority
    from torch.utils._triton import has_triton

    assert support.triton_available() == has_triton()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_automatic_selection_on_cpu_picks_chunked_even_with_the_interpreter(monkeypatch):
    monkeypatch.delenv("OPAKE_KERNEL_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for op in ops.MODEL_OPS:
        choice = kernel_choice(op, "cpu")
        assert choice.backend == "chunked"
        assert choice.reason.startswith("automatic")


def test_explicit_beats_environment_beats_automatic(monkeypatch):
    monkeypatch.setenv("OPAKE_KERNEL_BACKEND", "torch")
    assert kernel_choice("rms_norm", "cpu").backend == "torch"
    assert "OPAKE_KERNEL_BACKEND" in kernel_choice("rms_norm", "cpu").reason
    assert kernel_choice("rms_norm", "cpu", backend="chunked").backend == "chunked"
    monkeypatch.setenv("OPAKE_KERNEL_BACKEND", "nonexistent")
    with pytest.raises(ConfigurationError, match=r"'nonexistent'.*not installed"):
        rms_norm(torch.ones(2, 2))


def test_environment_variable_routes_the_public_entry_point(monkeypatch):
    calls = []

    class Spy:
        @staticmethod
        def lce(*args, **kwargs):
            calls.append(kwargs)
            return torch.zeros(())

        @hookimpl
        def opake_kernel_backends(self):
            return [KernelBackend("spy", {"linear_cross_entropy": self.lce}, devices=("cpu",))]

    register_plugin(Spy(), name="spy")
    monkeypatch.setenv("OPAKE_KERNEL_BACKEND", "spy")
    linear_cross_entropy(torch.ones(2, 3), torch.ones(4, 3), torch.zeros(2, dtype=torch.long))
    assert calls
    assert calls[0]["reduction"] == "mean"
    assert calls[0]["chunk_size"] is True


def test_explicit_backend_that_cannot_run_raises():
    with pytest.raises(OperationError, match="requested explicitly"):
        kernel_choice("linear_cross_entropy", "mps", backend="triton")

    class Unavailable:
        @hookimpl
        def opake_kernel_backends(self):
            return [
                KernelBackend(
                    "ghost",
                    {"rms_norm": "opake.kernels.torch:rms_norm"},
                    devices=("cpu",),
                    priority=100,
                    available=lambda: False,
                )
            ]

    register_plugin(Unavailable(), name="ghost")
    with pytest.raises(OperationError, match="'ghost' is not available"):
        rms_norm(torch.ones(2, 2), backend="ghost")
    # automatic selection skips it quietly, despite its priority
    assert kernel_choice("rms_norm", "cpu").backend != "ghost"


def test_automatic_selection_falls_back_to_the_reference():
    class OnlyCuda:
        @hookimpl
        def opake_kernel_backends(self):
            return [KernelBackend("fast", {"rms_norm": "math:hypot"}, ("cuda",), priority=99)]

    register_plugin(OnlyCuda(), name="only-cuda")
    assert kernel_choice("rms_norm", "xpu").backend in ("chunked", "torch")
    assert kernel_choice("rms_norm", "cpu").backend != "fast"


def test_triton_ops_refuse_cpu_tensors_without_the_interpreter(monkeypatch):
    import opake.kernels.triton._device as triton_device
    from opake.kernels.triton import rms_norm

    monkeypatch.setattr(triton_device, "interpreting", lambda: False)
    with pytest.raises(OperationError, match="Use backend='chunked' on the CPU"):
        rms_norm(torch.ones(2, 4), torch.ones(4))


def test_importing_opake_kernels_imports_neither_torch_nor_triton():
    code = (
        "import sys, opake.kernels, opake.kernels._plugin as p; p.opake_kernel_backends(); "
        "print('torch' in sys.modules, 'triton' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
