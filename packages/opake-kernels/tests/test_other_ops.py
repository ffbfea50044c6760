"""Targeted tests of cross_entropy, rms_norm, swiglu/geglu and rope beyond the reference matrix."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import grad, vmap

from opake.kernels import cross_entropy, geglu, rms_norm, rope, swiglu
from opake.kernels.testing import loop_grads, vmap_grads

FUSED = ["chunked", "triton"]


def _saved_numels(fn):
    """Number of elements autograd saves for backward while running *fn*."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(sizes)


def test_chunked_ops_save_less_than_autograd(gen):
    x = torch.randn(64, 32, generator=gen, requires_grad=True)
    u = torch.randn(64, 32, generator=gen, requires_grad=True)
    w = torch.randn(32, generator=gen, requires_grad=True)
    for fn in (
        lambda be: swiglu(x, u, backend=be),
        lambda be: geglu(x, u, approximate="tanh", backend=be),
        lambda be: rms_norm(x.half(), w, backend=be),
    ):
        assert _saved_numels(lambda f=fn: f("chunked")) < _saved_numels(lambda f=fn: f("torch"))
    # rms_norm keeps x, weight and one fp32 number per row; swiglu keeps its two inputs
    assert _saved_numels(lambda: rms_norm(x, w, backend="chunked")) == 64 * 32 + 32 + 64
    assert _saved_numels(lambda: swiglu(x, u, backend="chunked")) == 2 * 64 * 32


def test_chunked_cross_entropy_on_bf16_logits(gen):
    logits = (torch.randn(6, 50, generator=gen) * 3).bfloat16().requires_grad_(True)
    labels = torch.randint(0, 50, (6,), generator=gen)
    labels[2] = -100
    got = cross_entropy(logits, labels, backend="chunked", softcap=5.0)
    (g,) = torch.autograd.grad(got, logits)
    want = cross_entropy(logits, labels, backend="torch", softcap=5.0)
    (gw,) = torch.autograd.grad(want, logits)
    assert got.dtype == torch.float32
    assert g.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g.float(), gw.float(), rtol=2e-2, atol=2e-3)
    assert g[2].abs().max().item() == 0.0


@pytest.mark.parametrize("backend", FUSED)
def test_rms_norm_with_per_example_weights_under_vmap(backend, gen, devices):
    dev = devices[backend]
    x = torch.randn(3, 5, 16, generator=gen).to(dev)
    w = (1 + 0.1 * torch.randn(3, 16, generator=gen)).to(dev)

    def f(xx, ww):
        return rms_norm(xx, ww, offset=1.0, backend=backend).pow(2).sum()

    def f_ref(xx, ww):
        return rms_norm(xx, ww, offset=1.0, backend="torch").pow(2).sum()

    got = vmap_grads(f, [x, w], (0, 1), (0, 1))
    want = loop_grads(f_ref, [x, w], (0, 1), (0, 1))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", FUSED)
def test_gated_activation_with_one_shared_input_under_vmap(backend, gen, devices):
    dev = devices[backend]
    gate = torch.randn(4, 7, generator=gen).to(dev)
    up = torch.randn(7, generator=gen).to(dev)

    def f(a, b):
        return swiglu(a, b, backend=backend).sum()

    with torch.no_grad():
        ga, gu = vmap(grad(f, argnums=(0, 1)), in_dims=(0, None))(gate, up)
    s = torch.sigmoid(gate)
    torch.testing.assert_close(ga, up * s * (1 + gate * (1 - s)), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gu, gate * s)


@pytest.mark.parametrize("backend", ["torch", *FUSED])
def test_rope_rotates_pairs_and_preserves_norm(backend, devices):
    dev = devices[backend]
    d = 8
    pos = torch.arange(5, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.outer(pos, inv)
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dev)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dev)
    x = torch.randn(2, 3, 5, d).to(dev)
    out = rope(x, cos, sin, backend=backend)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    # position 0 is the identity; pair (0, d/2) at position 1 turns by angle inv[0] = 1 rad
    torch.testing.assert_close(out[..., 0, :], x[..., 0, :])
    c, s = math.cos(1.0), math.sin(1.0)
    x0, x1 = x[..., 1, 0], x[..., 1, d // 2]
    torch.testing.assert_close(out[..., 1, 0], x0 * c - x1 * s, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[..., 1, d // 2], x1 * c + x0 * s, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", FUSED)
def test_rope_table_gradients(backend, gen, devices):
    dev = devices[backend]
    x = torch.randn(2, 4, 6, generator=gen).to(dev)
    cos = torch.randn(4, 6, generator=gen).to(dev).requires_grad_(True)
    sin = torch.randn(4, 6, generator=gen).to(dev).requires_grad_(True)
    got = torch.autograd.grad(rope(x, cos, sin, backend=backend).pow(2).sum(), (cos, sin))
    want = torch.autograd.grad(rope(x, cos, sin, backend="torch").pow(2).sum(), (cos, sin))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", FUSED)
def test_cross_entropy_per_example_under_vmap_equals_loop(backend, gen, devices):
    dev = devices[backend]
    logits = torch.randn(3, 5, 40, generator=gen).to(dev)
    labels = torch.randint(0, 40, (3, 5), generator=gen).to(dev)
    labels[2] = -100

    def f(z, y):
        return cross_entropy(z, y, backend=backend, label_smoothing=0.1, logit_divisor=2.0)

    def f_ref(z, y):
        return cross_entropy(z, y, backend="torch", label_smoothing=0.1, logit_divisor=2.0)

    (got,) = vmap_grads(f, [logits, labels], (0,), (0, 1))
    (want,) = loop_grads(f_ref, [logits, labels], (0,), (0, 1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got[2].abs().max().item() == 0.0
