"""Every op of every backend against the torch reference (values, grads, vmap per-example grads).

The checks themselves live in :mod:`opake.kernels.testing` (the public checker third-party
backends use); this file runs them for ``chunked`` and ``triton`` (interpreter on CPU) and tests
that the checker catches a wrong backend.
"""

from __future__ import annotations

import pytest
import torch

from opake.core import ops
from opake.core.plugins import KernelBackend, hookimpl, register_plugin
from opake.kernels.testing import Sizes, check_backend, loop_grads, vmap_grads

DTYPES = (torch.float32, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_backend_matches_reference(dtype):
    report = check_backend("chunked", dtypes=(dtype,))
    assert (
        len(report) == len(ops.MODEL_OPS) + 2
    )  # geglu is checked exact and tanh; and clip_accumulate
    assert all("ok" in line for line in report)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "op", [op for op in (*ops.MODEL_OPS, ops.CLIP_ACCUMULATE) if op != ops.LINEAR_CROSS_ENTROPY]
)
def test_triton_backend_matches_reference(op, dtype, devices):
    report = check_backend("triton", ops=(op,), dtypes=(dtype,), device=devices["triton"])
    assert report
    assert all("ok" in line for line in report)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_linear_cross_entropy_matches_reference(dtype, devices):
    # vocab 90 is not a multiple of the 32-wide interpreter tile; tokens 8 < the 16-row tile
    sizes = Sizes(batch=3, tokens=8, hidden=32, vocab=90)
    report = check_backend(
        "triton",
        ops=("linear_cross_entropy",),
        dtypes=(dtype,),
        device=devices["triton"],
        sizes=sizes,
    )
    assert "shared and batched weight" in report[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["chunked", "triton"])
def test_bf16_on_gpu_matches_reference(backend):
    report = check_backend(backend, dtypes=(torch.bfloat16,), device="cuda")
    assert all("ok" in line for line in report)


class _WrongGradPlugin:
    """A backend whose swiglu forward is right but whose gradient is 10 % too large."""

    @staticmethod
    def swiglu(gate, up):
        ref = torch.nn.functional.silu(gate) * up
        return ref + 0.1 * (ref - ref.detach())

    @hookimpl
    def opake_kernel_backends(self):
        return [KernelBackend("wrong", {"swiglu": self.swiglu}, devices=("cpu",))]


def test_checker_catches_a_wrong_gradient():
    register_plugin(_WrongGradPlugin(), name="wrong-grad")
    with pytest.raises(AssertionError, match=r"swiglu .*grad of arg 0"):
        check_backend("wrong", dtypes=(torch.float32,))


def test_loop_oracle_agrees_with_vmap_on_plain_torch():
    x = torch.randn(4, 3)
    w = torch.randn(3)

    def f(xx, ww):
        return (torch.tanh(xx * ww) ** 2).sum()

    got = vmap_grads(f, [x, w], (0, 1), (0,))
    want = loop_grads(f, [x, w], (0, 1), (0,))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    assert got[1].shape == (4, 3)  # one weight gradient per example
