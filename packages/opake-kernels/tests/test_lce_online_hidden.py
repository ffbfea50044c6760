"""The chunked linear cross-entropy's forward forming the hidden states' gradient across
vocabulary tiles (a frozen projection whose vocabulary does not fit one tile, as under LoRA on
a large vocabulary): the running-max rescaling against the fp64 torch reference, for every loss
variant, under ``vmap(grad)``, and the fall-backs (label smoothing, a trainable projection)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import grad, vmap

from opake.kernels import linear_cross_entropy
from opake.kernels.chunked import _loss_cores

VARIANTS = [
    {},
    {"softcap": 3.0},
    {"logit_scale": 0.7},
    {"logit_divisor": 1.5, "softcap": 2.0},
]


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the online forward ran."""
    seen: list[int] = []
    real = _loss_cores._lce_forward_online

    def spy(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_loss_cores, "_lce_forward_online", spy)
    return seen


def _case(gen: torch.Generator, b: int, t: int, h: int, v: int, scale: float = 1.0):
    hidden = torch.randn(b, t, h, generator=gen) * scale
    weight = torch.randn(v, h, generator=gen) * h**-0.5
    labels = torch.randint(0, v, (b, t), generator=gen)
    labels[0, -2:] = -100
    if b > 2:
        labels[2] = -100  # an example with no token at all
    return hidden, weight, labels


def _reference(hidden, weight, labels, upstream, reduction, bias=None, **opts):
    ref_h = hidden.double().requires_grad_(True)
    ref = linear_cross_entropy(
        ref_h,
        weight.double(),
        labels,
        bias=None if bias is None else bias.double(),
        reduction=reduction,
        backend="torch",
        **opts,
    )
    (ref * upstream.double()).sum().backward()
    return ref.detach().double(), ref_h.grad.double()


@pytest.mark.parametrize("reduction", ["per_example", "mean", "sum"])
@pytest.mark.parametrize("opts", VARIANTS)
def test_hidden_gradient_across_vocabulary_tiles_equals_the_reference(gen, calls, reduction, opts):
    b, t, h, v = 4, 6, 16, 101
    hidden, weight, labels = _case(gen, b, t, h, v)
    bias = torch.randn(v, generator=gen)  # frozen, like the weight
    upstream = torch.rand(b if reduction == "per_example" else (), generator=gen) + 0.5
    got_h = hidden.clone().requires_grad_(True)
    got = linear_cross_entropy(
        got_h, weight, labels, bias=bias, reduction=reduction, chunk_size=16, **opts
    )
    (got * upstream).sum().backward()
    ref, ref_grad = _reference(hidden, weight, labels, upstream, reduction, bias=bias, **opts)
    assert calls  # the vocabulary (101) spans several tiles of 16
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_h.grad.double(), ref_grad, rtol=1e-5, atol=1e-6)
    assert float(got_h.grad[2].abs().max()) == 0.0


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    v=st.integers(2, 90),
    tile=st.integers(1, 40),
    scale=st.sampled_from([0.01, 1.0, 30.0]),
    variant=st.sampled_from(range(len(VARIANTS))),
)
def test_hidden_gradient_search_over_tiles_and_logit_ranges(seed, v, tile, scale, variant):
    gen = torch.Generator().manual_seed(seed)
    b, t, h = 3, 4, 8
    hidden, weight, labels = _case(gen, b, t, h, v, scale)
    upstream = torch.rand(b, generator=gen) + 0.5
    got_h = hidden.clone().requires_grad_(True)
    got = linear_cross_entropy(
        got_h, weight, labels, reduction="per_example", chunk_size=tile, **VARIANTS[variant]
    )
    (got * upstream).sum().backward()
    ref, ref_grad = _reference(hidden, weight, labels, upstream, "per_example", **VARIANTS[variant])
    # large logits (scale 30) make a tile raise the running max by hundreds: the rescaling
    # must still give the reference's gradient
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_h.grad.double(), ref_grad, rtol=1e-4, atol=1e-5)


def test_under_vmap_grad_each_example_gets_its_own_hidden_gradient(gen, calls):
    b, t, h, v = 3, 5, 8, 70
    hidden, weight, labels = _case(gen, b, t, h, v)

    def loss(x, y):
        return linear_cross_entropy(x, weight, y, chunk_size=16)

    got = vmap(grad(loss))(hidden, labels)
    assert calls
    for i in range(b):
        ref_h = hidden[i].double().requires_grad_(True)
        ref = linear_cross_entropy(ref_h, weight.double(), labels[i], backend="torch")
        (want,) = torch.autograd.grad(ref, ref_h) if labels[i].ne(-100).any() else (None,)
        if want is None:
            assert float(got[i].abs().max()) == 0.0
        else:
            torch.testing.assert_close(got[i].double(), want, rtol=1e-5, atol=1e-6)


def test_bf16_inputs_match_the_reference_within_bf16_rounding(gen, calls):
    hidden, weight, labels = _case(gen, 2, 6, 16, 90)
    got_h = hidden.bfloat16().requires_grad_(True)
    got = linear_cross_entropy(got_h, weight.bfloat16(), labels, chunk_size=32)
    got.backward()
    ref, ref_grad = _reference(
        hidden.bfloat16().float(), weight.bfloat16().float(), labels, torch.ones(()), "mean"
    )
    assert calls
    assert got_h.grad.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_h.grad.double(), ref_grad, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("case", ["label_smoothing", "trainable_weight", "one_tile", "no_grad"])
def test_other_cases_take_the_recomputing_paths(gen, calls, case):
    hidden, weight, labels = _case(gen, 2, 5, 8, 60)
    opts = {"label_smoothing": 0.1} if case == "label_smoothing" else {}
    weight = weight.clone().requires_grad_(case == "trainable_weight")
    chunk = 60 if case == "one_tile" else 16
    got_h = hidden.clone().requires_grad_(case != "no_grad")
    with torch.set_grad_enabled(case != "no_grad"):
        got = linear_cross_entropy(got_h, weight, labels, chunk_size=chunk, **opts)
    assert not calls
    ref, ref_grad = _reference(hidden, weight.detach(), labels, torch.ones(()), "mean", **opts)
    torch.testing.assert_close(got.double().detach(), ref, rtol=1e-5, atol=1e-6)
    if case != "no_grad":
        got.backward()
        torch.testing.assert_close(got_h.grad.double(), ref_grad, rtol=1e-5, atol=1e-6)
