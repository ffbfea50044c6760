"""The chunked kernels' backward passes: how many full-size elementwise passes they make.

On the CPU these kernels are memory-bound; every extra pass over a chunk costs about as much
as the arithmetic. The counts below are what the kernels need (values are checked against the
reference elsewhere): a rewrite that brings back redundant passes fails here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from opake.kernels.chunked import _layer_cores, _loss_cores


class _FullSizeOps(TorchDispatchMode):
    """Records the ops (not views or allocations) that produce a tensor of ``numel`` elements."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel = numel
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        counted = name not in {"empty", "empty_like", "empty_strided"} and not func.is_view
        if counted and isinstance(out, torch.Tensor) and out.numel() == self.numel:
            self.ops.append(name)
        return out


@pytest.mark.parametrize(("kind", "passes"), [("silu", 4), ("gelu", 4), ("gelu_tanh", 4)])
def test_gated_backward_makes_four_passes_per_chunk(kind, passes):
    gen = torch.Generator().manual_seed(0)
    gate, up, g = (torch.randn(64, 32, generator=gen) for _ in range(3))
    with _FullSizeOps(gate.numel()) as mode:
        ga, gu = _layer_cores.gated_backward(gate, up, g, kind, chunk=gate.numel())
    # act(gate); act·g into grad_up; g·up into grad_gate; act'(gate) applied in place
    assert len(mode.ops) <= passes, mode.ops
    a = gate.clone().requires_grad_()
    u = up.clone().requires_grad_()
    f = torch.nn.functional
    approximate = "tanh" if kind == "gelu_tanh" else "none"
    act = f.silu(a) if kind == "silu" else f.gelu(a, approximate=approximate)
    ref = act * u
    ea, eu = torch.autograd.grad(ref, (a, u), g)
    torch.testing.assert_close(ga, ea, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gu, eu, rtol=1e-6, atol=1e-6)


def test_rms_norm_backward_of_the_input_makes_four_passes_per_chunk():
    gen = torch.Generator().manual_seed(0)
    x, gy = torch.randn(64, 32, generator=gen), torch.randn(64, 32, generator=gen)
    w = torch.randn(32, generator=gen)
    _y, rstd = _layer_cores.rms_norm_forward(x, w, 1e-6, 0.0, rows=64)
    with _FullSizeOps(x.numel()) as mode:
        gx, gw = _layer_cores.rms_norm_backward(x, w, rstd, gy, 0.0, (True, False), 1, rows=64)
    # u = g·w; the row dots u·x; gx = rstd·u; gx -= x·(rstd³·(u·x)/d) in place
    assert len(mode.ops) <= 4, mode.ops
    assert gw is None
    xr = x.clone().requires_grad_()
    ref = w * (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(gx, torch.autograd.grad(ref, xr, gy)[0], rtol=1e-5, atol=1e-6)


def test_fused_linear_cross_entropy_forward_passes_per_tile():
    """One tile holding the whole vocabulary: logits, max shift, exp, the normalisation and
    the token gradients in one pass, the target subtraction; no running rescale."""
    from opake.kernels._args import loss_spec

    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(16, 8, generator=gen), torch.randn(40, 8, generator=gen)
    labels = torch.randint(0, 40, (16,), generator=gen)
    spec = loss_spec(
        (16,),
        ignore_index=-100,
        reduction="mean",
        logit_scale=None,
        logit_divisor=None,
        softcap=None,
        label_smoothing=0.0,
    )
    with _FullSizeOps(16 * 40) as mode:
        tok, _lse, stash = _loss_cores.lce_forward(
            hidden, weight, None, labels, spec, (16, 40), (True, False, False)
        )
    assert mode.ops == ["mm", "sub_", "exp_", "mul_", "scatter_add_"], mode.ops
    assert stash is not None
    assert stash[0] is not None
    h = hidden.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(h @ weight.t(), labels)
    torch.testing.assert_close(tok.mean(), ref.detach())
    torch.testing.assert_close(stash[0], torch.autograd.grad(ref, h)[0])


class _AllOps(TorchDispatchMode):
    """Records every op (with its overload) that is not a view."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_gated_forward_in_fp32_writes_the_activation_into_its_output():
    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(64, 32, generator=gen), torch.randn(64, 32, generator=gen)
    with _AllOps() as mode:
        out = _layer_cores.gated_forward(gate, up, "silu", chunk=gate.numel())
    # one allocation (the output), no temporary activation
    assert mode.ops == ["aten.empty_like.default", "aten.silu.out", "aten.mul_.Tensor"]
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=0, atol=0)
