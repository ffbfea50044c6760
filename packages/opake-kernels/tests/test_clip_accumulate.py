"""The fused clip-and-accumulate op: every backend against an fp64 torch reference.

The ``triton`` backend runs on CPU tensors in the Triton interpreter here (``conftest`` sets
``TRITON_INTERPRET=1`` before the kernel module is imported), the same kernel that runs on CUDA.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opake.core import ops
from opake.core.errors import ConfigurationError, InputTypeError
from opake.kernels import clip_accumulate, kernel_choice

pytest.importorskip("triton")
BACKENDS = ("torch", "chunked", "triton")


def _reference(grads, factors, sums):
    """fp64: ``s + Σ_i f_ij · nan_to_num(g_j[i])`` and the bound ``Σ_i |f_ij · g_j[i]|``."""
    out, scale = [], []
    for j, (g, s) in enumerate(zip(grads, sums, strict=True)):
        flat = g.reshape(g.shape[0], -1).double().nan_to_num(0.0, 0.0, 0.0)
        f = factors[:, j].double()
        out.append(s.double() + (f @ flat).reshape(s.shape))
        scale.append((f.abs() @ flat.abs()).reshape(s.shape) + s.double().abs())
    return out, scale


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_equals_the_torch_path_across_leaves_dtypes_and_blocks(backend, devices):
    gen = torch.Generator().manual_seed(0)
    m = 4
    shapes = [(3,), (5, 7), (700,), (2, 513)]  # within one block, and across block edges
    grads = [torch.randn(m, *shape, generator=gen) for shape in shapes]
    grads[1][2, 1, 3] = float("nan")
    grads[2][0, 10] = float("inf")
    grads[3][1, 0, 0] = float("-inf")
    grads.append(torch.randn(m, 6, 4, generator=gen).half())  # a second dtype: its own launch
    grads.append(torch.randn(m, 9, generator=gen).bfloat16())
    factors = torch.rand(m, len(grads), generator=gen)
    factors[2] = 0.0  # a non-finite example has factor 0: 0·NaN must not poison the sum
    device = devices[backend]
    grads = [g.to(device) for g in grads]
    sums = [torch.randn(g.shape[1:], generator=gen).to(device) for g in grads]
    expected, _ = _reference(grads, factors, sums)
    ran = clip_accumulate(grads, factors.to(device), sums, backend=backend)
    assert ran == ("triton" if backend == "triton" else "torch")
    for got, want in zip(sums, expected, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


_values = st.one_of(
    st.floats(-1e30, 1e30, allow_nan=False),
    st.sampled_from([0.0, 1e-40, -1e-40, 1e-30, float("nan"), float("inf"), -float("inf")]),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    m=st.integers(1, 5),
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    data=st.data(),
)
def test_fused_op_equals_the_torch_path_on_adversarial_gradients(m, sizes, data):
    """Factors in [0, 1]; huge, tiny, NaN and infinite entries: the fused op and the torch
    path agree, to fp32 rounding of the sum, and a zero factor removes an example exactly."""
    draw = data.draw
    grads = [
        torch.tensor(draw(st.lists(_values, min_size=m * n, max_size=m * n))).reshape(m, n)
        for n in sizes
    ]
    factors = torch.tensor(
        draw(
            st.lists(
                st.floats(0.0, 1.0, width=32), min_size=m * len(sizes), max_size=m * len(sizes)
            )
        )
    ).reshape(m, len(sizes))
    results = {}
    for backend in ("torch", "triton"):
        sums = [torch.zeros(n) for n in sizes]
        clip_accumulate(grads, factors, sums, backend=backend)
        results[backend] = sums
    expected, scale = _reference(grads, factors, [torch.zeros(n) for n in sizes])
    for fused, plain, want, bound in zip(
        results["triton"], results["torch"], expected, scale, strict=True
    ):
        assert torch.isfinite(fused).all()
        assert torch.isfinite(plain).all()
        for got in (fused, plain):
            assert ((got.double() - want).abs() <= 1e-6 * bound + 1e-44).all()


@settings(max_examples=15, deadline=None)
@given(
    keep=st.integers(0, 3),
    factor=st.floats(0.0, 1.0, width=32),
    garbage=st.sampled_from([float("nan"), float("inf"), -float("inf"), 3e38]),
)
def test_only_the_kept_example_moves_the_sum_by_exactly_its_scaled_gradient(keep, factor, garbage):
    """Every other example has factor 0 and carries garbage: the sum moves by f·g exactly."""
    g = torch.full((4, 5), garbage)
    g[keep] = torch.linspace(-2.0, 3.0, 5)
    factors = torch.zeros(4, 1)
    factors[keep, 0] = factor
    want = (torch.tensor(factor) * g[keep]).tolist()
    for backend in ("torch", "triton"):
        sums = [torch.zeros(5)]
        clip_accumulate([g], factors, sums, backend=backend)
        assert sums[0].tolist() == want, backend


def test_under_vmap_each_slice_accumulates_its_own_examples():
    """Inside ``vmap`` the triton backend cannot launch on batched tensors: it runs the
    reference (same numbers), so the op composes with ``torch.func``."""
    gen = torch.Generator().manual_seed(3)
    grads = torch.randn(2, 3, 6, generator=gen)
    factors = torch.rand(2, 3, 1, generator=gen)

    def one(backend):
        def fn(g, f):
            s = torch.zeros(6)
            s = s + 0.0 * g[0]  # batched like the slice
            clip_accumulate([g], f, [s], backend=backend)
            return s

        return torch.func.vmap(fn)(grads, factors)

    eager = torch.stack([(factors[k, :, 0] @ grads[k]) for k in range(2)])
    for backend in BACKENDS:
        torch.testing.assert_close(one(backend), eager)


def test_choice_is_logged_and_unusable_inputs_fall_back_loudly(monkeypatch, caplog):
    monkeypatch.delenv("OPAKE_KERNEL_BACKEND", raising=False)
    caplog.set_level(logging.INFO)
    from opake.core.plugins import _select

    monkeypatch.setattr(_select, "_reported", set())
    choice = kernel_choice(ops.CLIP_ACCUMULATE, "cpu")
    assert choice.backend == "chunked"  # the reference; triton only on a GPU automatically
    assert any(
        "clip_accumulate" in r.getMessage() for r in caplog.records if r.name == "opake.core"
    )
    from opake.kernels.triton import _clip

    monkeypatch.setattr(_clip, "_reported", set())
    caplog.clear()
    g = torch.ones(3, 2).t()  # [2 examples, 3] non-contiguous
    sums = [torch.zeros(3)]
    assert clip_accumulate([g], torch.ones(2, 1), sums, backend="triton") == "torch"
    assert sums[0].tolist() == [2.0, 2.0, 2.0]
    assert any(
        "not contiguous" in r.getMessage() for r in caplog.records if r.name == "opake.kernels"
    )


def test_a_shared_accumulator_runs_the_reference():
    """Two leaves adding into one tensor: the fused blocks would race, so the reference runs."""
    grads = [torch.ones(2, 3), torch.full((2, 3), 2.0)]
    total = torch.zeros(3)
    ran = clip_accumulate(grads, torch.full((2, 2), 0.5), [total, total], backend="triton")
    assert ran == "torch"
    assert total.tolist() == [3.0, 3.0, 3.0]


def test_bad_input_raises_typed_errors():
    with pytest.raises(ConfigurationError, match="one sum per gradient"):
        clip_accumulate([torch.ones(2, 3)], torch.ones(2, 2), [torch.zeros(3)])
    with pytest.raises(ConfigurationError, match=r"expected \[2, \*sum.shape\]"):
        clip_accumulate([torch.ones(2, 3)], torch.ones(2, 1), [torch.zeros(4)])
    with pytest.raises(ConfigurationError, match="must be fp32"):
        clip_accumulate([torch.ones(2, 3)], torch.ones(2, 1), [torch.zeros(3).half()])
    with pytest.raises(InputTypeError, match="list of tensors"):
        clip_accumulate(torch.ones(2, 3), torch.ones(2, 1), [torch.zeros(3)])
    with pytest.raises(InputTypeError, match="factors"):
        clip_accumulate([torch.ones(2, 3)], [[1.0], [1.0]], [torch.zeros(3)])
