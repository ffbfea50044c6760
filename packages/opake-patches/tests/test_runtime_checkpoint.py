"""The vmap-safe checkpoint: same gradients as without checkpointing, under grad and vmap(grad)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch import nn
from torch.func import functional_call, grad, jacrev, jvp, vmap

from opake.core.errors import OperationError
from opake.patches.runtime import vmap_checkpoint


class Blocks(nn.Module):
    """Residual MLP blocks; ``mode`` picks how each block is checkpointed."""

    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 1)
        self.mode = "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        if self.mode == "sequential":
            h = tuc.checkpoint_sequential(
                nn.Sequential(*self.blocks), len(self.blocks), h, use_reentrant=False
            )
        else:
            for blk in self.blocks:
                if self.mode == "none":
                    h = h + blk(h)
                elif self.mode == "module":
                    h = h + tuc.checkpoint(blk, h, use_reentrant=False)
                elif self.mode == "reentrant":
                    h = h + tuc.checkpoint(blk, h, use_reentrant=True)
                elif self.mode == "closure":
                    h = h + tuc.checkpoint(lambda t, blk=blk: blk(t), h, use_reentrant=False)
                elif self.mode == "method":
                    h = h + tuc.checkpoint(blk.forward, h, use_reentrant=False)
                elif self.mode == "partial_plain":
                    h = h + _scaled(blk, h, scale=torch.ones_like(h) * 0.5)
                elif self.mode == "partial":
                    scale = torch.ones_like(h) * 0.5  # a tensor held by the partial
                    fn = functools.partial(_scaled, blk, scale=scale)
                    h = h + tuc.checkpoint(fn, h, use_reentrant=False)
        return self.head(h).squeeze(-1)


def _scaled(blk: nn.Module, t: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
    return blk(t) * scale * 2.0


def _per_example_grads(model: Blocks, mode: str, x, y, *, outer_no_grad: bool = True):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        model.mode = mode
        return (functional_call(model, p, (xi,)) - yi) ** 2

    fn = vmap(grad(loss), in_dims=(None, 0, 0))
    if outer_no_grad:
        with torch.no_grad():
            return fn(params, x, y)
    return fn(params, x, y)


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, value in a.items():
        torch.testing.assert_close(value, b[k], rtol=1e-5, atol=1e-6, msg=k)


def _clip_and_sum(grads: dict, c: float) -> dict:
    """Per-example clipping to norm c, then the sum (the DP-SGD gradient before noise)."""
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))
    factor = (c / (norms + 1e-6)).clamp(max=1.0)
    return {k: (g * factor.view(-1, *[1] * (g.dim() - 1))).sum(0) for k, g in grads.items()}


@pytest.fixture
def data():
    torch.manual_seed(0)
    return Blocks(), torch.randn(5, 8), torch.randn(5)


@pytest.mark.parametrize("mode", ["module", "reentrant", "closure", "method", "partial"])
def test_vmap_grad_matches_unchecked(patched, data, mode):
    model, x, y = data
    ref = _per_example_grads(model, "partial_plain" if mode == "partial" else "none", x, y)
    got = _per_example_grads(model, mode, x, y)
    _assert_same(ref, got)
    _assert_same(_clip_and_sum(ref, 0.1), _clip_and_sum(got, 0.1))


@pytest.mark.parametrize("microbatch_size", [None, 2])
def test_clipped_grad_with_checkpointed_blocks(patched, data, microbatch_size):
    """clipped_grad (vmap over vjp, backward after the vjp level exits) with checkpointing."""
    from opake.dpsgd.clipping import clipped_grad
    from opake.functional import make_functional

    model, x, y = data
    fmodel, params = make_functional(model)

    def loss_fn(p, xi, yi, mode):
        model.mode = mode
        return (fmodel(p, xi) - yi) ** 2

    results = []
    for mode in ("none", "module", "partial"):
        grad_fn, state = clipped_grad(
            functools.partial(loss_fn, mode=mode),
            clipping_norm=0.1,
            batch_argnums=(1, 2),
            microbatch_size=microbatch_size,
            check_unused=False,
        )
        results.append(grad_fn(params, x, y, state=state)[0])
    expected = _clip_and_sum(_per_example_grads(model, "none", x, y), 0.1)
    _assert_same(dict(results[0]), expected)
    _assert_same(dict(results[1]), expected)
    partial_ref = clipped_grad(
        functools.partial(loss_fn, mode="partial_plain"),
        clipping_norm=0.1,
        batch_argnums=(1, 2),
        check_unused=False,
    )
    _assert_same(dict(results[2]), dict(partial_ref[0](params, x, y, state=partial_ref[1])[0]))


def test_checkpoint_sequential_under_vmap_grad(patched):
    torch.manual_seed(1)
    seq = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)])
    params = {k: v.detach() for k, v in seq.named_parameters()}
    x = torch.randn(3, 6)

    def loss(p, xi, ckpt):
        with torch.nn.utils.stateless._reparametrize_module(seq, p):
            out = tuc.checkpoint_sequential(seq, 2, xi, use_reentrant=False) if ckpt else seq(xi)
        return out.pow(2).sum()

    with torch.no_grad():
        ref = vmap(grad(functools.partial(loss, ckpt=False)), in_dims=(None, 0))(params, x)
        got = vmap(grad(functools.partial(loss, ckpt=True)), in_dims=(None, 0))(params, x)
    _assert_same(ref, got)


def test_grad_without_vmap_and_input_gradients(patched, data):
    model, x, y = data
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi, mode):
        model.mode = mode
        return (functional_call(model, p, (xi,)) - yi) ** 2

    with torch.no_grad():
        ref = grad(loss, argnums=(0, 1))(params, x[0], y[0], "none")
        got = grad(loss, argnums=(0, 1))(params, x[0], y[0], "module")
    _assert_same(ref[0], got[0])
    torch.testing.assert_close(ref[1], got[1])


def test_region_is_recomputed_in_backward(patched):
    calls = []
    lin = nn.Linear(4, 4)

    def region(t):
        calls.append(t.shape)
        return torch.tanh(lin(t))

    with torch.no_grad():
        vmap(grad(lambda t: tuc.checkpoint(region, t, use_reentrant=False).sum()))(
            torch.randn(3, 4)
        )
    assert len(calls) == 2  # forward once, recompute once in backward


def test_frozen_parameters_and_non_tensor_outputs(patched):
    torch.manual_seed(2)
    lin = nn.Linear(4, 4)

    def region(t, k):  # a tuple output with a non-tensor and an integer tensor
        return torch.tanh(lin(t)) * k, "tag", (t > 0).long()

    def loss(w, t, ckpt):
        with torch.nn.utils.stateless._reparametrize_module(lin, {"weight": w}):
            out, tag, ints = (
                tuc.checkpoint(region, t, 3.0, use_reentrant=False) if ckpt else region(t, 3.0)
            )
        assert tag == "tag"
        return out.sum() + ints.sum()

    x = torch.randn(3, 4)
    w = lin.weight.detach()
    with torch.no_grad():
        ref = vmap(grad(functools.partial(loss, ckpt=False)), in_dims=(None, 0))(w, x)
        got = vmap(grad(functools.partial(loss, ckpt=True)), in_dims=(None, 0))(w, x)
    torch.testing.assert_close(ref, got)


def test_dropout_rng_is_replayed(patched):
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(6, 24), nn.Dropout(0.5), nn.Linear(24, 6))
    net.train()
    params = {k: v.detach() for k, v in net.named_parameters()}
    x = torch.randn(4, 6)

    def loss(p, xi, ckpt):
        with torch.nn.utils.stateless._reparametrize_module(net, p):
            out = tuc.checkpoint(net, xi, use_reentrant=False) if ckpt else net(xi)
        return out.pow(2).sum()

    results = []
    for ckpt in (False, True):
        torch.manual_seed(11)
        with torch.no_grad():
            g = vmap(
                grad(functools.partial(loss, ckpt=ckpt)), in_dims=(None, 0), randomness="different"
            )(params, x)
        results.append((g, torch.rand(1)))  # the RNG stream continues identically, too
    _assert_same(results[0][0], results[1][0])
    assert results[0][1].item() == results[1][1].item()


def test_outside_transforms_the_stock_function_runs(patched):
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    out = tuc.checkpoint(lin, x, use_reentrant=False)
    # stock non-reentrant checkpointing keeps the ordinary graph (recomputing through
    # saved-tensor hooks); Opake's path would show a _VmapCheckpointBackward node here
    assert type(out.grad_fn).__name__ == "AddmmBackward0"
    out.sum().backward()
    ref = torch.autograd.grad(lin(x).sum(), x)[0]
    torch.testing.assert_close(x.grad, ref)
    out = tuc.checkpoint(lin, x, use_reentrant=True)
    assert type(out.grad_fn).__name__ == "CheckpointFunctionBackward"


# torch's forward-mode AD scripts a helper on first use (a torch-internal deprecation)
@pytest.mark.filterwarnings("ignore:.*torch.jit.script.*:DeprecationWarning")
def test_higher_order_differentiation_raises(patched):
    lin = nn.Linear(3, 3)

    def f(t):
        return tuc.checkpoint(lin, t, use_reentrant=False).tanh().sum()

    x = torch.randn(3)
    with torch.no_grad():
        with pytest.raises(OperationError, match="higher-order"):
            grad(lambda t: grad(f)(t).sum())(x)
        with pytest.raises(OperationError, match="higher-order"):
            jacrev(grad(f))(x)
        with pytest.raises(OperationError, match="forward-mode"):
            vmap(lambda t: jvp(f, (t,), (t,)))(x[None])


def test_outer_autograd_that_could_differentiate_again_raises(patched):
    lin = nn.Linear(3, 3)  # real parameters: requires_grad=True below every transform

    def f(t):
        return tuc.checkpoint(lin, t, use_reentrant=False).tanh().sum()

    with pytest.raises(OperationError, match=r"torch\.no_grad"):
        vmap(grad(f))(torch.randn(2, 3))
    with torch.no_grad():  # the documented way
        vmap(grad(f))(torch.randn(2, 3))


def test_grad_mode_on_is_fine_when_nothing_requires_grad_outside(patched, data):
    model, x, y = data
    ref = _per_example_grads(model, "none", x, y)
    got = _per_example_grads(model, "module", x, y, outer_no_grad=False)
    _assert_same(ref, got)


def test_selective_checkpointing_and_hidden_tensors_raise(patched):
    lin = nn.Linear(3, 3)
    with torch.no_grad(), pytest.raises(OperationError, match="context_fn"):
        vmap(grad(lambda t: tuc.checkpoint(lin, t, context_fn=lambda: (None, None)).sum()))(
            torch.randn(2, 3)
        )

    class Holder:  # a tensor on an arbitrary object cannot be lifted
        pass

    def loss(w, t):
        holder = Holder()
        holder.w = w
        return tuc.checkpoint(lambda u: (u * holder.w).sum(), t, use_reentrant=False)

    with torch.no_grad(), pytest.raises(OperationError, match="captured a tensor"):
        vmap(grad(loss), in_dims=(None, 0))(torch.randn(3), torch.randn(2, 3))


def test_vmap_without_grad_then_plain_backward(patched):
    torch.manual_seed(4)
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    out = vmap(lambda t: tuc.checkpoint(lin, t, use_reentrant=False))(x)
    out.tanh().sum().backward()
    got = lin.weight.grad.clone()
    lin.zero_grad()
    lin(x).tanh().sum().backward()
    torch.testing.assert_close(got, lin.weight.grad)


def test_torch_compile_over_checkpointed_transform_raises(patched):
    lin = nn.Linear(4, 4)

    def f(t):
        return tuc.checkpoint(lin, t, use_reentrant=False).tanh().sum()

    torch._dynamo.reset()
    compiled = torch.compile(vmap(grad(f)), backend="eager")
    try:
        with torch.no_grad(), pytest.raises(OperationError, match=r"torch\.compile"):
            compiled(torch.randn(3, 4))
    finally:
        torch._dynamo.reset()
    # the refusal leaves no global state behind: saved-tensor hooks work again
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()


def test_vmap_checkpoint_function_directly():
    """``vmap_checkpoint`` also works without the patches installed."""
    lin = nn.Linear(3, 3)
    x = torch.randn(4, 3)
    with torch.no_grad():
        got = vmap(grad(lambda t: vmap_checkpoint(lin, t).pow(2).sum()))(x)
    ref = vmap(grad(lambda t: lin(t).pow(2).sum()))(x)
    torch.testing.assert_close(got, ref)


GLOBAL_BLOCK = nn.Sequential(nn.Linear(4, 4), nn.Tanh())


def _uses_global_block(t):
    return GLOBAL_BLOCK(t)


class _Runner:
    """A plain object holding a module: its bound method is checkpointed."""

    def __init__(self, block):
        self.block = block

    def run(self, t):
        return self.block(t)


@pytest.mark.parametrize("how", ["global", "object_attribute", "list_in_closure"])
def test_modules_reached_through_globals_objects_and_containers(patched, how):
    torch.manual_seed(5)
    block = GLOBAL_BLOCK
    params = {k: v.detach() for k, v in block.named_parameters()}
    runner = _Runner(block)
    blocks = [block]

    def region(t):
        return blocks[0](t)

    fn = {"global": _uses_global_block, "object_attribute": runner.run, "list_in_closure": region}[
        how
    ]

    def loss(p, t, ckpt):
        with torch.nn.utils.stateless._reparametrize_module(block, p):
            out = tuc.checkpoint(fn, t, use_reentrant=False) if ckpt else fn(t)
        return out.pow(2).sum()

    x = torch.randn(3, 4)
    with torch.no_grad():
        ref = vmap(grad(functools.partial(loss, ckpt=False)), in_dims=(None, 0))(params, x)
        got = vmap(grad(functools.partial(loss, ckpt=True)), in_dims=(None, 0))(params, x)
    _assert_same(ref, got)
