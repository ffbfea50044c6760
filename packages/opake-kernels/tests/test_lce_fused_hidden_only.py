"""The chunked linear cross-entropy's forward forming the hidden states' gradient alone (a frozen
projection, as under LoRA): its tiles then span several examples' tokens; every example's loss
and the hidden states' gradient against the torch reference."""

from __future__ import annotations

import pytest
import torch

from opake.kernels import linear_cross_entropy
from opake.kernels.chunked._workspace import resolve_chunking


@pytest.mark.parametrize("reduction", ["per_example", "mean", "sum"])
@pytest.mark.parametrize("opts", [{}, {"softcap": 3.0, "label_smoothing": 0.1, "logit_scale": 0.7}])
def test_hidden_gradient_of_a_frozen_projection_with_tiles_across_examples(gen, reduction, opts):
    b, t, h, v = 4, 5, 16, 37
    hidden = torch.randn(b, t, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * h**-0.5
    labels = torch.randint(0, v, (b, t), generator=gen)
    labels[1, 2:] = -100
    labels[3] = -100  # an example with no token at all
    # the tiles span the vocabulary and more tokens than one example has
    tt, vt = resolve_chunking(True, "cpu", h, v, torch.float32, tokens=b * t)
    assert vt == v
    assert tt > t
    upstream = torch.rand(b if reduction == "per_example" else (), generator=gen) + 0.5
    got_h = hidden.clone().requires_grad_(True)
    got = linear_cross_entropy(got_h, weight, labels, reduction=reduction, **opts)
    ref_h = hidden.double().requires_grad_(True)
    ref = linear_cross_entropy(
        ref_h, weight.double(), labels, reduction=reduction, backend="torch", **opts
    )
    torch.testing.assert_close(got.double(), ref.double(), rtol=1e-5, atol=1e-6)
    (got * upstream).sum().backward()
    (ref * upstream.double()).sum().backward()
    torch.testing.assert_close(got_h.grad.double(), ref_h.grad.double(), rtol=1e-5, atol=1e-6)
    assert float(got_h.grad[3].abs().max()) == 0.0
