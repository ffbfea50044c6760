"""Tests for opake.dpsgd.optimizer.autocast_loss: bf16/fp16 compute, fp32 unscaled gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from opake.core.errors import ConfigurationError, InputTypeError
from opake.dpsgd.optimizer import DEFAULT_FP16_LOSS_SCALE, autocast_loss


def make_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def data(n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=gen), torch.randint(0, 4, (n,), generator=gen)


def per_example(loss_fn, params, x, y):  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return vmap(grad(loss_fn), in_dims=(None, 0, 0))(params, x, y)


def test_bf16_per_example_grads_are_fp32_and_match_an_autocast_loop() -> None:
    model = make_mlp()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_fn(p, x, y):  # type: ignore[no-untyped-def]
        return F.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    x, y = data()
    got = per_example(autocast_loss(loss_fn, torch.bfloat16), params, x, y)
    # reference: a per-example loop with plain autograd under the same autocast
    for i in range(x.shape[0]):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x[i : i + 1])
        assert logits.dtype == torch.bfloat16
        loss = F.cross_entropy(logits.float(), y[i : i + 1])
        ref = torch.autograd.grad(loss, list(model.parameters()))
        for (name, g), r in zip(got.items(), ref, strict=True):
            assert g.dtype == torch.float32
            torch.testing.assert_close(g[i], r, rtol=2e-2, atol=1e-3, msg=name)
    # and it really computed in bf16: it differs from the fp32 gradients
    exact = per_example(loss_fn, params, x, y)
    assert not all(torch.equal(got[k], exact[k]) for k in got)
    for k in got:
        torch.testing.assert_close(got[k], exact[k], rtol=5e-2, atol=5e-3)


def test_fp16_scale_is_removed_exactly_before_the_gradient_leaves() -> None:
    model = make_mlp()
    params = {k: v.detach() for k, v in model.named_parameters()}
    scale = 2.0**12

    def loss_fn(p, x, y):  # type: ignore[no-untyped-def]
        return F.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    def scaled_by_hand(p, x, y):  # type: ignore[no-untyped-def]
        with torch.autocast("cpu", dtype=torch.float16):
            out = functional_call(model, p, (x[None],))
        return F.cross_entropy(out.float(), y[None]) * scale

    x, y = data()
    got = per_example(autocast_loss(loss_fn, torch.float16, loss_scale=scale), params, x, y)
    by_hand = per_example(scaled_by_hand, params, x, y)
    for k in got:
        assert got[k].dtype == torch.float32
        assert torch.equal(got[k], by_hand[k] / scale), k  # bitwise: power-of-two unscale
    # the loss value itself is returned unscaled
    wrapped = autocast_loss(loss_fn, torch.float16, loss_scale=scale)
    plain_fp16 = autocast_loss(loss_fn, torch.float16, loss_scale=1.0)
    assert torch.equal(wrapped(params, x[0], y[0]), plain_fp16(params, x[0], y[0]))


def test_fp16_loss_scale_rescues_gradients_that_underflow() -> None:
    w = torch.full((8,), 0.5)
    x = torch.linspace(0.5, 1.5, 8)

    def tiny_loss(w, x):  # type: ignore[no-untyped-def]
        return (x @ w).float() * 1e-8  # backward value 1e-8 is below fp16's smallest subnormal

    exact = grad(tiny_loss)(w, x)
    unscaled = grad(autocast_loss(tiny_loss, torch.float16, loss_scale=1.0))(w, x)
    rescued = grad(autocast_loss(tiny_loss, torch.float16))(w, x)
    assert torch.count_nonzero(unscaled) == 0
    assert torch.count_nonzero(rescued) == 8
    torch.testing.assert_close(rescued, exact, rtol=1e-2, atol=0.0)
    assert DEFAULT_FP16_LOSS_SCALE == 2.0**10


def test_overflowing_example_is_non_finite_and_others_are_untouched() -> None:
    w = torch.ones(4)
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0e4, 3.0e4, 3.0e4, 3.0e4]])

    def loss_fn(w, x):  # type: ignore[no-untyped-def]
        return (x @ w).float().square() * 1e-3

    got = vmap(grad(autocast_loss(loss_fn, torch.float16, loss_scale=2.0**4)), (None, 0))(w, x)
    assert torch.isfinite(got[0]).all()
    assert not torch.isfinite(got[1]).all()  # clipping zeroes such an example
    torch.testing.assert_close(got[0], grad(loss_fn)(w, x[0]), rtol=1e-3, atol=0.0)


def test_has_aux_and_argnums_tuple() -> None:
    a, b = torch.ones(3), torch.full((3,), 2.0)

    def loss_fn(a, b, x):  # type: ignore[no-untyped-def]
        loss = (a * b * x).sum()
        return loss, {"value": loss.detach()}

    wrapped = autocast_loss(loss_fn, "float16", argnums=(0, 1), has_aux=True, loss_scale=8.0)
    (ga, gb), aux = grad(wrapped, argnums=(0, 1), has_aux=True)(a, b, torch.ones(3))
    assert torch.equal(ga, torch.full((3,), 2.0))
    assert torch.equal(gb, torch.ones(3))
    assert float(aux["value"]) == 6.0


def test_bad_input() -> None:
    def loss_fn(w):  # type: ignore[no-untyped-def]
        return w.sum()

    with pytest.raises(ConfigurationError, match=r"bfloat16 or torch\.float16"):
        autocast_loss(loss_fn, torch.float32)
    with pytest.raises(ConfigurationError, match="power of two"):
        autocast_loss(loss_fn, torch.float16, loss_scale=1000.0)
    with pytest.raises(InputTypeError, match="power of two"):
        autocast_loss(loss_fn, torch.float16, loss_scale="big")  # type: ignore[arg-type]
    with pytest.raises(InputTypeError, match="argnums"):
        autocast_loss(loss_fn, argnums=-1)
    with pytest.raises(InputTypeError, match="callable"):
        autocast_loss(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        autocast_loss(loss_fn, scale=2.0)  # type: ignore[call-arg]
    half = torch.ones(3, dtype=torch.float16)
    with pytest.raises(ConfigurationError, match="keep trainable parameters in fp32"):
        autocast_loss(loss_fn, torch.float16)(half)
    with pytest.raises(InputTypeError, match="has_aux=True"):
        autocast_loss(lambda w: (w.sum(), 1))(torch.ones(2))
    with pytest.raises(InputTypeError, match="positional"):
        autocast_loss(loss_fn, argnums=2)(torch.ones(2))
