"""What the book-keeping engine's certified clipping needs from the linear-CE example grads:
an absolute bound no cancellation shrinks, and exact rows of one example's gradient; and the
loss-only head clipped under a cancellation attack (two equally likely tokens, alternating
labels, huge hidden states: the per-token gradients cancel)."""

from __future__ import annotations

import math

import pytest
import torch

from opake.dpsgd.bookkeeping import BatchedLoss, implicit_use
from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional
from opake.kernels import linear_cross_entropy
from opake.kernels import linear_cross_entropy_example_grads as example_grads
from opake.kernels.chunked import linear_cross_entropy_recorded

OPTIONS = {"plain": {}, "everything": {"logit_scale": 0.8, "softcap": 3.0, "label_smoothing": 0.1}}


def _per_example(hidden, weight, labels, grads, **opts):
    out = []
    for i in range(hidden.shape[0]):
        w = weight.detach().clone().requires_grad_(True)
        tok = linear_cross_entropy(
            hidden[i], w, labels[i], reduction="none", backend="torch", **opts
        )
        (tok * grads[i]).sum().backward()
        out.append(w.grad)
    return torch.stack(out)


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("route", ["ghost", "materialised"])
def test_abs_norms_and_example_rows(option, route):
    gen = torch.Generator().manual_seed(0)
    b, t, h, v = 3, 5, 8, 23
    hidden = torch.randn(b, t, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * h**-0.5
    labels = torch.randint(0, v, (b, t), generator=gen)
    labels[1, 2:] = -100
    grads = torch.rand(b, t, generator=gen) + 0.5
    opts = OPTIONS[option]
    op = example_grads(hidden, weight, labels, grads, chunk_size=7, route=route, **opts)
    want = _per_example(hidden.double(), weight.double(), labels, grads.double(), **opts)
    # rows of one example, in blocks, reproduce its gradient
    for i in range(b):
        rows = torch.cat([op.example_rows(i, s, min(v, s + 6)) for s in range(0, v, 6)])
        assert rows.dtype == torch.float64
        torch.testing.assert_close(rows, want[i], rtol=1e-5, atol=1e-6)
    # Σ_t ‖d_t‖‖h_t‖: at least the norm, and exactly that sum (d from autograd per token)
    bound = op.abs_norms()
    assert bound.dtype == torch.float64
    assert bool((bound >= want.square().sum((1, 2)).sqrt() * (1 - 1e-6)).all())
    for i in range(b):
        total = 0.0
        for s in range(t):
            one = torch.zeros(t, dtype=torch.float64)
            one[s] = grads[i, s]
            d = _per_example(
                hidden[i : i + 1, s : s + 1].double(),
                weight.double(),
                labels[i : i + 1, s : s + 1],
                one[None, s : s + 1],
                **opts,
            )
            total += float(d.square().sum().sqrt())
        assert math.isclose(float(bound[i]), total, rel_tol=1e-5, abs_tol=1e-9)


class _Head(torch.nn.Module):
    """A linear map, then the loss-only head through the recorded linear-CE op."""

    def __init__(self, h: int, v: int) -> None:
        super().__init__()
        self.body = torch.nn.Linear(h, h)
        self.head = torch.nn.Linear(h, v, bias=False)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.body(x)
        use = implicit_use(self.head)
        if use is None:
            tok = linear_cross_entropy(hidden, self.head.weight, labels, reduction="none")
        else:
            tok, record = linear_cross_entropy_recorded(
                hidden, self.head.weight.detach(), labels, route="ghost"
            )

            def build(g: torch.Tensor) -> dict[str, object]:
                return {"weight": record.example_grads(g.reshape(labels.shape))}

            tok = use.tap(tok, build)
        return tok.reshape(labels.shape).sum(dim=1)


@pytest.mark.parametrize(("big", "sigma"), [(1e4, 1.0), (1e4, 1e-2), (1e5, 1.0)])
def test_loss_only_head_is_clipped_under_cancellation(big, sigma):
    """Example 1: hidden states ``big·u + noise`` where tokens 0 and 1 share a head row (always
    equally likely) and its labels alternate between them: the per-token gradients cancel up
    to the noise (before certification this example contributed up to 1.06·C)."""
    torch.manual_seed(0)
    h, v, t = 8, 16, 8
    model = _Head(h, v)
    with torch.no_grad():
        model.body.weight.copy_(torch.eye(h))
        model.body.bias.zero_()
        model.head.weight[1] = model.head.weight[0]
    fmodel, params = make_functional(model)
    loss = BatchedLoss(fmodel, fmodel)
    x = torch.randn(3, t, h)
    unit = model.head.weight[0].detach() / model.head.weight[0].norm()
    x[1] = big * unit + sigma * torch.randn(t, h)
    labels = torch.randint(0, v, (3, t))
    labels[1] = torch.tensor([0, 1] * (t // 2))
    grad_fn, state = clipped_grad(
        loss, clipping_norm=1.0, batch_argnums=(1, 2), engine="bookkeeping"
    )
    for i in range(3):
        mask = torch.zeros(3, dtype=torch.bool)
        mask[i] = True
        grads, _ = grad_fn(params, x, labels, state=state, example_mask=mask)
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
        assert norm <= 1.0 + 1e-6, (i, norm)
