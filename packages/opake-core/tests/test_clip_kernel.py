"""The fused multi-tensor clip-and-accumulate kernel, run on CPU in the Triton interpreter.

``OPAKE_CLIP_KERNEL=interpret`` with ``TRITON_INTERPRET=1`` launches the same Triton kernel
that runs on CUDA, interpreted on CPU tensors; each test defines the kernel anew (Triton reads
``TRITON_INTERPRET`` when a kernel is defined) and drops it afterwards.
"""

from __future__ import annotations

import os
import sys

import torch

if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ:
    # Triton decides at import whether its own jit'd helpers (tl.zeros …) are interpreted
    os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"

import pytest

from opake.core import testing
from opake.core.errors import ConfigurationError
from opake.dpsgd.clipping import _kernel as _clip_kernel
from opake.dpsgd.clipping import clipped_grad


@pytest.fixture
def interpreted(monkeypatch):
    tl = pytest.importorskip("triton.language")
    if type(tl.zeros).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported without TRITON_INTERPRET=1 (a CUDA machine)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("OPAKE_CLIP_KERNEL", "interpret")
    monkeypatch.setattr(_clip_kernel, "_KERNEL", None)
    monkeypatch.delitem(sys.modules, "opake.dpsgd.clipping._kernel_triton", raising=False)
    yield
    _clip_kernel._KERNEL = None
    sys.modules.pop("opake.dpsgd.clipping._kernel_triton", None)  # defined under the interpreter


def _torch_reference(grads, factors, sums):
    return [
        s.double()
        + (
            factors[:, j].double() @ g.reshape(g.shape[0], -1).double().nan_to_num(0.0, 0.0, 0.0)
        ).reshape(s.shape)
        for j, (g, s) in enumerate(zip(grads, sums, strict=True))
    ]


@pytest.mark.usefixtures("interpreted")
def test_kernel_equals_the_torch_path_across_leaves_dtypes_and_blocks():
    gen = torch.Generator().manual_seed(0)
    m = 4
    shapes = [(3,), (5, 7), (700,), (2, 513)]  # within one block, and across block edges
    grads = [torch.randn(m, *shape, generator=gen) for shape in shapes]
    grads[1][2, 1, 3] = float("nan")
    grads[2][0, 10] = float("inf")
    grads[3][1, 0, 0] = float("-inf")
    grads.append(torch.randn(m, 6, 4, generator=gen).half())  # a second dtype: its own launch
    factors = torch.rand(m, len(grads), generator=gen)
    factors[2] = 0.0  # a non-finite example has factor 0: 0·NaN must not poison the sum
    sums = [torch.randn(g.shape[1:], generator=gen) for g in grads]
    expected = _torch_reference(grads, factors, sums)
    assert _clip_kernel.clip_accumulate(grads, factors, sums) == "triton"
    for got, want in zip(sums, expected, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_torch_path_without_opt_in(monkeypatch):
    monkeypatch.delenv("OPAKE_CLIP_KERNEL", raising=False)
    grads = [torch.tensor([[1.0, float("nan")], [2.0, 3.0]])]
    sums = [torch.ones(2)]
    assert _clip_kernel.clip_accumulate(grads, torch.tensor([[2.0], [0.5]]), sums) == "torch"
    torch.testing.assert_close(sums[0], torch.tensor([4.0, 2.5]))


def test_vmap_engine_uses_the_kernel_and_equals_the_loop(interpreted, monkeypatch, mlp, mlp_batch):
    from opake.functional import make_functional

    def no_torch_path(*_):
        raise AssertionError("the torch scale-and-sum ran instead of the fused kernel")

    monkeypatch.setattr(_clip_kernel, "_torch_path", no_torch_path)
    fmodel, params = make_functional(mlp)

    def loss_fn(p, x, y):
        return torch.nn.functional.cross_entropy(fmodel(p, x[None]), y[None])

    calls = []
    real = _clip_kernel.clip_accumulate

    def spy(*args):
        calls.append(real(*args))
        return calls[-1]

    import opake.dpsgd.clipping._engine as engine

    monkeypatch.setattr(engine, "clip_accumulate", spy)
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=0.5, batch_argnums=(1, 2), microbatch_size=4, method="vmap"
    )
    grads, _ = grad_fn(params, *mlp_batch, state=state)
    assert calls == ["triton"] * 3  # 10 examples, microbatches of 4
    expected = testing.reference_clipped_grad(
        loss_fn, (params, *mlp_batch), clipping_norm=0.5, batch_argnums=(1, 2)
    )
    testing.assert_grads_close(grads, expected, rtol=1e-5)


def test_bad_settings_are_loud(monkeypatch):
    monkeypatch.setenv("OPAKE_CLIP_KERNEL", "fast")
    with pytest.raises(ConfigurationError, match="OPAKE_CLIP_KERNEL='fast'"):
        _clip_kernel.kernel_runs_on(torch.device("cpu"))
    monkeypatch.setenv("OPAKE_CLIP_KERNEL", "interpret")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigurationError, match="TRITON_INTERPRET=1"):
        _clip_kernel.kernel_runs_on(torch.device("cpu"))
    with pytest.raises(ConfigurationError, match="one sum per gradient"):
        _clip_kernel.clip_accumulate([torch.ones(2, 3)], torch.ones(2, 2), [torch.zeros(3)])
