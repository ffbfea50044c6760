"""The vmap engine's clip-and-accumulate: the kernel op when a backend provides one, else torch.

The fused Triton kernel itself is tested in opake-kernels; here: which path the engine takes,
the torch fallback without opake-kernels, and the engine with the fused kernel (run on CPU in the
Triton interpreter when no GPU is present) against the per-example reference.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ:
    # Triton decides at import whether its own jit'd helpers (tl.zeros …) are interpreted
    os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"

import pytest

from opake.core import ops, testing
from opake.core.errors import ConfigurationError, OperationError
from opake.core.plugins import KernelBackend, reset_plugins
from opake.dpsgd.clipping import _kernel as _clip_kernel
from opake.dpsgd.clipping import clipped_grad


@pytest.fixture(autouse=True)
def _fresh_plugins():
    reset_plugins()
    yield
    reset_plugins()


@pytest.fixture
def interpreted(monkeypatch):
    """The ``triton`` backend chosen explicitly; on CPU in the interpreter."""
    pytest.importorskip("opake.kernels")
    tl = pytest.importorskip("triton.language")
    if type(tl.zeros).__name__ != "InterpretedFunction" and not torch.cuda.is_available():
        pytest.skip("triton was imported without TRITON_INTERPRET=1 and there is no GPU")
    if type(tl.zeros).__name__ == "InterpretedFunction":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("OPAKE_KERNEL_BACKEND", "triton")
    reset_plugins()  # the triton backend registers the CPU only under the interpreter


def test_torch_path_without_opt_in(monkeypatch):
    monkeypatch.delenv("OPAKE_KERNEL_BACKEND", raising=False)
    grads = [torch.tensor([[1.0, float("nan")], [2.0, 3.0]])]
    sums = [torch.ones(2)]
    assert _clip_kernel.clip_accumulate(grads, torch.tensor([[2.0], [0.5]]), sums) == "torch"
    torch.testing.assert_close(sums[0], torch.tensor([4.0, 2.5]))
    assert not _clip_kernel.kernel_runs_on(torch.device("cpu"))  # the reference: inline


def test_torch_fallback_without_a_backend_for_the_op(monkeypatch, caplog):
    """opake-kernels not installed: no backend provides the op; the torch path runs, logged."""
    monkeypatch.setenv("OPAKE_DISABLE_PLUGIN_AUTOLOAD", "1")  # as if nothing is installed
    reset_plugins()
    monkeypatch.setattr(_clip_kernel, "_reported", set())
    monkeypatch.delenv("OPAKE_KERNEL_BACKEND", raising=False)
    caplog.set_level(logging.INFO, logger="opake.core")
    sums = [torch.zeros(2)]
    grads = [torch.tensor([[1.0, float("inf")], [3.0, 4.0]])]
    assert _clip_kernel.clip_accumulate(grads, torch.tensor([[0.5], [0.0]]), sums) == "torch"
    assert sums[0].tolist() == [0.5, 0.0]
    assert not _clip_kernel.kernel_runs_on(torch.device("cpu"))
    assert any("install opake-kernels" in r.getMessage() for r in caplog.records)


def test_vmap_engine_uses_the_kernel_and_equals_the_loop(interpreted, monkeypatch, mlp, mlp_batch):
    from opake.functional import make_functional

    def no_torch_path(*_):
        raise AssertionError("the torch scale-and-sum ran instead of the fused kernel")

    monkeypatch.setattr(_clip_kernel, "torch_clip_accumulate", no_torch_path)
    fmodel, params = make_functional(mlp)

    def loss_fn(p, x, y):
        return torch.nn.functional.cross_entropy(fmodel(p, x[None]), y[None])

    calls = []
    real = _clip_kernel.clip_accumulate

    def spy(*args):
        calls.append(real(*args))
        return calls[-1]

    import opake.dpsgd.clipping._vmap_engine as engine

    monkeypatch.setattr(engine, "clip_accumulate", spy)
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=0.5, batch_argnums=(1, 2), microbatch_size=4, engine="vmap"
    )
    grads, _ = grad_fn(params, *mlp_batch, state=state)
    assert calls == ["triton"] * 3  # 10 examples, microbatches of 4
    expected = testing.reference_clipped_grad(
        loss_fn, (params, *mlp_batch), clipping_norm=0.5, batch_argnums=(1, 2)
    )
    testing.assert_grads_close(grads, expected, rtol=1e-5)


def test_bad_settings_are_loud(monkeypatch):
    monkeypatch.setenv("OPAKE_KERNEL_BACKEND", "fast")
    with pytest.raises(ConfigurationError, match="'fast'"):
        _clip_kernel.kernel_runs_on(torch.device("cpu"))
    monkeypatch.delenv("OPAKE_KERNEL_BACKEND")
    with pytest.raises(ConfigurationError, match="one sum per gradient"):
        _clip_kernel.clip_accumulate([torch.ones(2, 3)], torch.ones(2, 2), [torch.zeros(3)])


def test_an_explicit_backend_without_the_op_raises(monkeypatch):
    from opake.core.plugins import hookimpl, register_plugin

    class Toy:
        @hookimpl
        def opake_kernel_backends(self):
            return [KernelBackend("toy", {ops.RMS_NORM: "math:hypot"}, devices=("cpu",))]

    register_plugin(Toy(), name="toy-backend")
    monkeypatch.setenv("OPAKE_KERNEL_BACKEND", "toy")
    with pytest.raises(OperationError, match="has no op 'clip_accumulate'"):
        _clip_kernel.kernel_runs_on(torch.device("cpu"))


def test_the_removed_switch_is_reported_not_silently_ignored(monkeypatch, caplog):
    monkeypatch.setattr(_clip_kernel, "_reported", set())
    monkeypatch.setenv("OPAKE_CLIP_KERNEL", "off")
    monkeypatch.delenv("OPAKE_KERNEL_BACKEND", raising=False)
    caplog.set_level(logging.WARNING, logger="opake.core")
    _clip_kernel.kernel_runs_on(torch.device("cpu"))
    _clip_kernel.kernel_runs_on(torch.device("cpu"))
    said = [r for r in caplog.records if "OPAKE_CLIP_KERNEL" in r.getMessage()]
    assert len(said) == 1  # once
    assert "OPAKE_KERNEL_BACKEND=torch" in said[0].getMessage()
