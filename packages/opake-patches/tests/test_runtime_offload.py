"""save_on_cpu around vmap(grad)/clipped_grad: identical gradients, checkpoint inputs offloaded."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch import nn
from torch.func import functional_call, grad, vmap

from opake.patches.runtime import OffloadPolicy, current_offload


def _net():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6)) for _ in range(3)]
    return nn.Sequential(*blocks)


def _loss(net, p, x, ckpt):
    with torch.nn.utils.stateless._reparametrize_module(net, p):
        h = x
        for blk in net:
            h = h + (tuc.checkpoint(blk, h, use_reentrant=False) if ckpt else blk(h))
    return h.pow(2).sum()


@pytest.fixture
def spy_policy(monkeypatch):
    """Record every host/device copy the checkpoint asks the offload policy for."""
    calls = {"to_host": 0, "to_device": 0}
    to_host, to_device = OffloadPolicy.to_host, OffloadPolicy.to_device

    def host(self, t):
        calls["to_host"] += 1
        return to_host(self, t)

    def device(self, t, d):
        calls["to_device"] += 1
        return to_device(self, t, d)

    monkeypatch.setattr(OffloadPolicy, "to_host", host)
    monkeypatch.setattr(OffloadPolicy, "to_device", device)
    return calls


@pytest.mark.parametrize("pin_memory", [False, True])
def test_save_on_cpu_around_vmap_grad_gives_identical_grads(patched, spy_policy, pin_memory):
    net = _net()
    params = {k: v.detach() for k, v in net.named_parameters()}
    x = torch.randn(4, 6)
    per_example = vmap(grad(functools.partial(_loss, net)), in_dims=(None, 0, None))
    with torch.no_grad():
        ref = per_example(params, x, False)
    with torch.autograd.graph.save_on_cpu(pin_memory=pin_memory):
        assert current_offload() == OffloadPolicy(pin_memory=pin_memory)
        with torch.no_grad():
            got = per_example(params, x, True)
        plain = per_example(params, x, False)  # no checkpoint: nothing to offload, still works
    assert current_offload() is None
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0)
        torch.testing.assert_close(plain[k], ref[k], rtol=0, atol=0)
    # three checkpointed blocks, one saved activation each, out and back again
    assert spy_policy["to_host"] == 3  # once per region, at the differentiated level


def test_save_on_cpu_around_clipped_grad(patched, spy_policy):
    from opake.dpsgd.clipping import clipped_grad
    from opake.functional import make_functional

    net = _net()
    fmodel, params = make_functional(net)
    x = torch.randn(5, 6)

    def loss_fn(p, xi):
        with torch.nn.utils.stateless._reparametrize_module(net, p):
            h = xi
            for blk in net:
                h = h + tuc.checkpoint(blk, h, use_reentrant=False)
        return h.pow(2).sum()

    grad_fn, state = clipped_grad(loss_fn, clipping_norm=0.5, batch_argnums=1, check_unused=False)
    ref, _ = grad_fn(params, x, state=state)
    with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
        got, _ = grad_fn(params, x, state=state)
    assert spy_policy["to_host"] == 3
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0)
    del fmodel


def test_outside_transforms_stock_hooks_still_run(patched):
    net = _net()
    x = torch.randn(3, 6, requires_grad=True)
    with torch.autograd.graph.save_on_cpu():
        pack, _ = torch._C._autograd._top_saved_tensors_default_hooks(True)
        out = net(x).pow(2).sum()
        grads = torch.autograd.grad(out, [x, *net.parameters()])
    assert pack.__qualname__.endswith("pack_to_cpu")  # torch's own hook
    ref = torch.autograd.grad(net(x).pow(2).sum(), [x, *net.parameters()])
    for a, b in zip(grads, ref, strict=True):
        torch.testing.assert_close(a, b)


def test_hooks_are_suspended_inside_transforms_and_restored(patched):
    lin = nn.Linear(3, 3)
    p = {k: v.detach() for k, v in lin.named_parameters()}
    with torch.autograd.graph.save_on_cpu():
        before = torch._C._autograd._top_saved_tensors_default_hooks(True)
        with torch.no_grad():
            vmap(grad(lambda q, t: functional_call(lin, q, (t,)).sum()), in_dims=(None, 0))(
                p, torch.randn(2, 3)
            )
        after = torch._C._autograd._top_saved_tensors_default_hooks(True)
        assert before is not None
        assert after == before
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


def test_someone_elses_hooks_still_raise(patched):
    lin = nn.Linear(3, 3)
    p = {k: v.detach() for k, v in lin.named_parameters()}
    with (
        torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        pytest.raises(RuntimeError, match="saved tensor hooks"),
    ):
        grad(lambda q: functional_call(lin, q, (torch.ones(3),)).sum())(p)


def test_entering_save_on_cpu_inside_a_transform(patched, spy_policy):
    lin = nn.Linear(3, 3)
    p = {k: v.detach() for k, v in lin.named_parameters()}

    def loss(q, t):
        with (
            torch.autograd.graph.save_on_cpu(),
            torch.nn.utils.stateless._reparametrize_module(lin, q),
        ):
            return tuc.checkpoint(lin, t, use_reentrant=False).tanh().sum()

    with torch.no_grad():
        got = vmap(grad(loss), in_dims=(None, 0))(p, torch.ones(2, 3))
    ref = vmap(grad(lambda q, t: functional_call(lin, q, (t,)).tanh().sum()), in_dims=(None, 0))(
        p, torch.ones(2, 3)
    )
    torch.testing.assert_close(got["weight"], ref["weight"])
    assert spy_policy["to_host"] == 1


def test_stock_save_on_cpu_fails_without_the_patch():
    """The failure the patch exists for (a guard that the tests above test something)."""
    lin = nn.Linear(3, 3)
    p = {k: v.detach() for k, v in lin.named_parameters()}
    with (
        torch.autograd.graph.save_on_cpu(),
        pytest.raises(RuntimeError, match="saved tensor hooks"),
    ):
        grad(lambda q: functional_call(lin, q, (torch.ones(3),)).sum())(p)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_checkpoint_inputs_really_move_to_pinned_host_memory(patched):
    policy = OffloadPolicy(pin_memory=True)
    t = torch.randn(4, 4, device="cuda")
    host = policy.to_host(t)
    assert host.device.type == "cpu"
    torch.cuda.synchronize()
    assert host.is_pinned()
    back = policy.to_device(host, t.device)
    torch.testing.assert_close(back, t)
