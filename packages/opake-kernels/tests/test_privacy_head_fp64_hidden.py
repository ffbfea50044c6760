"""Regression tests of a red-team finding: the loss-only head's clipped sum with fp64 hidden
states (an fp64 model, or ``clipped_grad(compute_dtype=torch.float64)``).

The head's weighted sums converted the fp64 hidden states to fp32 *before* scaling them by the
clip factor and the upstream token gradient, while the certificate measured them in fp64. An
entry beyond fp32's range became an infinity (the example's contribution NaN, the whole sum
poisoned, the example still counted finite), and entries in fp32's subnormal range carried an
absolute error that a large token gradient multiplied (1.33·C at C = 10⁻⁴). Now every path
of the head (the kept logit gradients, their Gram form, and the recomputed tiles) scales and
contracts fp64 hidden states in fp64 and rounds to fp32 once. (Without kept gradients or their
Gram matrices the engine refuses the head: that clipped sum is outside the proof.) Each test
isolates one example's contribution (``example_mask``) and checks it against the exact oracle.
"""

from __future__ import annotations

import math

import pytest
import torch

from opake.core import testing
from opake.dpsgd.bookkeeping import BatchedLoss, implicit_use
from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional
from opake.kernels.chunked import _kept, linear_cross_entropy_recorded
from opake.kernels.chunked._kept import wide_contraction

EXACT = 1.0 + 1e-12
F64 = torch.float64


class _Head(torch.nn.Module):
    """A bias-free head through the recorded linear-CE op; per-token loss weights are data."""

    def __init__(self, hsize: int, vocab: int, keep: bool) -> None:
        super().__init__()
        self.head = torch.nn.Linear(hsize, vocab, bias=False, dtype=F64)
        self.keep = keep
        self.vocab = vocab

    def forward(self, h: torch.Tensor, labels: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        w = self.head.weight
        use = implicit_use(self.head)
        if use is None:  # the per-example reference (first-call check, vmap engine)
            z = h @ w.T
            ce = torch.nn.functional.cross_entropy(
                z.reshape(-1, self.vocab), labels.reshape(-1), reduction="none"
            )
            return (ce.reshape(labels.shape) * wt).sum(-1)
        tok, rec = linear_cross_entropy_recorded(h, w.detach(), labels, keep_logit_grads=self.keep)
        tok = use.tap(tok, lambda g: {"weight": rec.example_grads(g.reshape(labels.shape))})
        return (tok.reshape(labels.shape) * wt).sum(-1)


def _setup(hsize: int, vocab: int, keep: bool, clip: float, steps: int, batch: int):
    torch.manual_seed(0)
    fmodel, params = make_functional(_Head(hsize, vocab, keep))
    grad_fn, state = clipped_grad(
        BatchedLoss(fmodel, fmodel),
        clipping_norm=clip,
        batch_argnums=(1, 2, 3),
        engine="bookkeeping",
    )
    benign = (
        torch.randn(batch, steps, hsize, dtype=F64),
        torch.randint(0, vocab, (batch, steps)),
        torch.ones(batch, steps, dtype=F64),
    )
    grad_fn(params, *benign, state=state)  # the first-call check runs on benign data
    return grad_fn, state, params


@pytest.fixture(params=["u", "gram"])
def form(request, monkeypatch):
    """What the forward keeps: the logit gradients ``u``, or (when they would not fit the
    memory) their Gram matrices, with the tiles recomputed once for the clipped sum."""
    if request.param == "gram":
        monkeypatch.setattr(_kept, "available_memory", lambda device: 0)
    return request.param


def test_hidden_states_beyond_fp32_range_add_a_finite_bounded_tensor(form):
    batch, steps, vocab = 3, 3, 4
    keep = True
    grad_fn, state, params = _setup(2, vocab, keep, 1.0, steps, batch)
    # small head weights keep the logits finite; one hidden coordinate is beyond fp32
    params = {"head.weight": torch.tensor([[1e-36, 0.0], [2e-36, 0.0], [0.0, 1.0], [-1e-36, 0.0]])}
    params["head.weight"] = params["head.weight"].to(F64)
    h = torch.randn(batch, steps, 2, dtype=F64)
    h[0, 0, 0] = 1e39
    labels = torch.randint(0, vocab, (batch, steps))
    labels[0, 0] = 0
    wt = torch.ones(batch, steps, dtype=F64)
    args = (params, h, labels, wt)
    got = testing.contribution(grad_fn, args, state=state, index=0, batch=batch)
    norm = testing.exact_norm(got)
    assert math.isfinite(norm), norm
    assert norm <= 1.0 * EXACT, norm
    out, _ = grad_fn(*args, state=state)
    assert bool(torch.isfinite(out["head.weight"]).all())


@pytest.mark.parametrize(
    ("clip", "mantissa"), [(1e-4, 1.5), (0.1, 2.0**10 + 0.5 + 2.0**-8)], ids=["1e-4", "0.1"]
)
def test_subnormal_range_hidden_states_with_huge_token_weights(form, clip, mantissa):
    batch, steps, hsize, vocab = 2, 64, 256, 4
    keep = True
    grad_fn, state, params = _setup(hsize, vocab, keep, clip, steps, batch)
    h = torch.randn(batch, steps, hsize, dtype=F64)
    h[0] = mantissa * 2.0**-149  # every entry rounds up when converted to fp32
    labels = torch.randint(0, vocab, (batch, steps))
    labels[0] = 0
    wt = torch.ones(batch, steps, dtype=F64)
    wt[0] = 2.0**127
    got = testing.contribution(grad_fn, (params, h, labels, wt), state=state, index=0, batch=batch)
    norm = testing.exact_norm(got)
    assert norm <= clip * EXACT, (norm / clip - 1.0) / 2.0**-24


def test_wide_contraction_scales_before_it_rounds():
    d = torch.ones(5, 3)
    hs = torch.full((5, 2), 3e-46, dtype=F64) * 2.0**120  # fp32 subnormal before the scaling
    want = (d.double().t() @ hs).float()
    assert torch.equal(wide_contraction(d, hs, tile=2), want)


def test_the_reference_clip_accumulate_scales_fp64_first():
    """The vmap engine's scale-and-sum (the torch reference every backend is tested against):
    an AUTO-S factor above 1 on fp64 gradients in fp32's subnormal range."""
    from opake.kernels.torch._clip import clip_accumulate

    crafted = (2.0**20 + 0.5 + 2.0**-10) * 2.0**-149  # rounds up when converted to fp32
    grads = [torch.full((2, 64), crafted, dtype=F64)]
    sums = [torch.zeros(64)]
    clip_accumulate(grads, torch.tensor([[2.0**125], [0.0]]), sums)
    assert torch.equal(sums[0], torch.full((64,), crafted * 2.0**125, dtype=F64).float())
