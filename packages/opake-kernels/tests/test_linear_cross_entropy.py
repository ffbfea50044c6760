"""Targeted tests of linear cross-entropy: masking, per-example reductions and gradients, tiling."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import grad, vmap
from torch.utils._python_dispatch import TorchDispatchMode

from opake.core.errors import ConfigurationError, OperationError
from opake.kernels import linear_cross_entropy
from opake.kernels.testing import loop_grads, vmap_grads

FUSED = ["chunked", "triton"]


def _inputs(gen, b=3, t=8, h=32, v=90, device="cpu", dtype=torch.float32):
    hidden = torch.randn(b, t, h, generator=gen).to(device, dtype)
    weight = (torch.randn(v, h, generator=gen) * h**-0.5).to(device, dtype)
    labels = torch.randint(0, v, (b, t), generator=gen).to(device)
    return hidden, weight, labels


def _ref(*args, **kwargs):
    return linear_cross_entropy(*args, backend="torch", **kwargs)


@pytest.mark.parametrize("backend", FUSED)
def test_all_ignored_example_has_zero_loss_and_zero_gradient(backend, gen, devices):
    dev = devices[backend]
    hidden, weight, labels = _inputs(gen, device=dev)
    labels[1] = -100
    labels[0, 3] = -100

    def loss(h, w, y):
        return linear_cross_entropy(h, w, y, backend=backend, softcap=3.0, label_smoothing=0.1)

    per_ex = linear_cross_entropy(
        hidden, weight, labels, backend=backend, reduction="per_example", softcap=3.0
    )
    assert per_ex[1].item() == 0.0
    gh, gw = vmap_grads(loss, [hidden, weight, labels], (0, 1), (0, 2))
    assert torch.isfinite(gh).all()
    assert torch.isfinite(gw).all()
    assert gh[1].abs().max().item() == 0.0
    assert gw[1].abs().max().item() == 0.0
    assert gw[0].abs().max().item() > 0.0
    # a whole batch of ignored tokens: mean is 0 (not NaN) and so are the gradients
    h = hidden.clone().requires_grad_(True)
    out = linear_cross_entropy(h, weight, torch.full_like(labels, -100), backend=backend)
    out.backward()
    assert out.item() == 0.0
    assert h.grad.abs().max().item() == 0.0


@pytest.mark.parametrize(
    ("backend", "chunk"), [("chunked", True), ("chunked", 32), ("triton", True)]
)
def test_per_example_weight_gradient_is_per_example_not_summed(backend, chunk, gen, devices):
    # chunked: True = one tile spans the vocabulary (gradients computed in the forward pass),
    # 32 = 2-D tiles (the backward recomputes them)
    dev = devices[backend]
    hidden, weight, labels = _inputs(gen, device=dev)
    labels[0, :2] = -100

    def loss(h, w, y):
        return linear_cross_entropy(h, w, y, backend=backend, chunk_size=chunk)

    with torch.no_grad():
        got = vmap(grad(loss, argnums=1), in_dims=(0, None, 0))(hidden, weight, labels)
    want = loop_grads(_ref, [hidden, weight, labels], (1,), (0, 2))[0]
    assert got.shape == (3, *weight.shape)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)
    # three different examples give three different gradients (a sum would repeat one tensor)
    assert (got[0] - got[1]).abs().max() > 1e-3
    torch.testing.assert_close(got.sum(0), want.sum(0), rtol=1e-4, atol=1e-4)


def test_per_example_reduction_is_each_examples_own_mean(gen):
    hidden, weight, labels = _inputs(gen)
    labels[2, 1:] = -100  # one token left: its mean is that token's loss, not diluted
    per_ex = _ref(hidden, weight, labels, reduction="per_example")
    loop = torch.stack([_ref(hidden[b], weight, labels[b]) for b in range(3)])
    torch.testing.assert_close(per_ex, loop)
    for backend in ("chunked",):
        got = linear_cross_entropy(hidden, weight, labels, reduction="per_example", backend=backend)
        torch.testing.assert_close(got, loop, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", FUSED)
def test_masked_lanes_never_leak_probability_through_the_softcap(backend, gen, devices):
    # vocab 33: a 32-wide tile leaves 31 padding lanes in the last vocabulary tile. A padding
    # lane masked to -inf *before* the softcap would come out as -softcap; one left at 0 would
    # come out as 0. Either way it would add probability mass that does not exist.
    dev = devices[backend]
    cap = 0.5
    hidden, weight, labels = _inputs(gen, v=33, device=dev)
    got = linear_cross_entropy(
        hidden, weight, labels, softcap=cap, reduction="none", backend=backend, chunk_size=32
    )
    want = _ref(hidden, weight, labels, softcap=cap, reduction="none")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the test has teeth: a leak of 31 lanes at logit -cap would move every loss by this much
    z = torch.tanh((hidden @ weight.T).float() / cap) * cap
    leaked = torch.logsumexp(torch.cat([z, torch.full((*z.shape[:-1], 31), -cap)], -1), -1)
    assert (leaked - torch.logsumexp(z, -1)).min() > 0.3


@pytest.mark.parametrize("backend", FUSED)
def test_vocab_and_tokens_not_multiples_of_the_tile(backend, gen, devices):
    dev = devices[backend]
    hidden, weight, labels = _inputs(gen, b=1, t=13, h=20, v=77, device=dev)
    bias = torch.randn(77, generator=gen).to(dev)
    kw = {"bias": bias, "logit_scale": 1.5, "logit_divisor": 0.7, "softcap": 4.0}
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    got = linear_cross_entropy(h, w, labels, backend=backend, chunk_size=16, **kw)
    got_grads = torch.autograd.grad(got, (h, w))
    want = _ref(h, w, labels, **kw)
    want_grads = torch.autograd.grad(want, (h, w))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


def test_chunk_size_settings_agree(gen):
    hidden, weight, labels = _inputs(gen)
    labels[1, 2] = -100
    results = []
    for chunk in (True, False, 0, 5, 7, 1000):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        loss = linear_cross_entropy(
            h, w, labels, backend="chunked", chunk_size=chunk, label_smoothing=0.2
        )
        results.append((loss, *torch.autograd.grad(loss, (h, w))))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _LargestTensor(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_chunked_never_materialises_the_logits(gen):
    tokens, hidden_size, vocab = 64, 8, 512
    hidden = torch.randn(tokens, hidden_size, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    with _LargestTensor() as mode:
        loss = linear_cross_entropy(hidden, weight, labels, backend="chunked", chunk_size=64)
        loss.backward()
    # weight-sized gradients are the largest thing; no (tokens, vocab) logits tensor existed
    assert mode.largest <= max(vocab * hidden_size, tokens * 64)
    assert mode.largest < tokens * vocab
    with _LargestTensor() as naive:
        _ref(hidden, weight, labels).backward()
    assert naive.largest >= tokens * vocab  # the reference does materialise them


@pytest.mark.parametrize("backend", FUSED)
def test_labels_outside_the_vocabulary_raise(backend, gen, devices):
    dev = devices[backend]
    hidden, weight, labels = _inputs(gen, device=dev)
    labels[0, 0] = 90
    with pytest.raises(ConfigurationError, match="label 90 is outside the vocabulary"):
        linear_cross_entropy(hidden, weight, labels, backend=backend)
    labels[0, 0] = 7
    linear_cross_entropy(hidden, weight, labels, ignore_index=7, backend=backend)


def test_ignore_index_inside_the_vocabulary(gen):
    hidden, weight, labels = _inputs(gen)
    labels[:, :3] = 0
    got = linear_cross_entropy(hidden, weight, labels, ignore_index=0, backend="chunked")
    want = _ref(hidden, weight, labels, ignore_index=0)
    torch.testing.assert_close(got, want)
    manual = _ref(hidden, weight, torch.where(labels == 0, -100, labels))
    torch.testing.assert_close(got, manual, rtol=1e-5, atol=1e-6)


def test_double_backward_is_refused(gen):
    hidden, weight, labels = _inputs(gen)
    h = hidden.clone().requires_grad_(True)
    loss = linear_cross_entropy(h, weight, labels, backend="chunked")
    (g,) = torch.autograd.grad(loss, h, create_graph=True)
    with pytest.raises(OperationError, match="first-order"):
        g.sum().backward()


def test_vmap_with_shared_hidden_and_batched_labels(gen):
    hidden, weight, labels = _inputs(gen, b=1)
    labels = torch.stack([labels[0], labels[0].flip(0), torch.full_like(labels[0], -100)])

    def loss(h, w, y):
        return linear_cross_entropy(h, w, y, backend="chunked")

    with torch.no_grad():
        got = vmap(grad(loss, argnums=(0, 1)), in_dims=(None, None, 0))(hidden[0], weight, labels)
    for b in range(3):
        want = torch.func.grad(lambda h, w, y=labels[b]: _ref(h, w, y), argnums=(0, 1))(
            hidden[0], weight
        )
        for a, c in zip((got[0][b], got[1][b]), want, strict=True):
            torch.testing.assert_close(a, c, rtol=1e-4, atol=2e-5)


def test_nested_vmap_matches_a_double_loop(gen):
    hidden = torch.randn(2, 3, 5, 16, generator=gen)
    weight = torch.randn(40, 16, generator=gen) * 0.25
    labels = torch.randint(0, 40, (2, 3, 5), generator=gen)
    labels[1, 2] = -100

    def loss(h, w, y):
        return linear_cross_entropy(h, w, y, backend="chunked", softcap=2.0)

    inner = vmap(grad(loss, argnums=1), in_dims=(0, None, 0))
    with torch.no_grad():
        got = vmap(inner, in_dims=(0, None, 0))(hidden, weight, labels)
    assert got.shape == (2, 3, 40, 16)
    for i in range(2):
        for j in range(3):
            w = weight.clone().requires_grad_(True)
            (want,) = torch.autograd.grad(_ref(hidden[i, j], w, labels[i, j], softcap=2.0), w)
            torch.testing.assert_close(got[i, j], want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("backend", FUSED)
def test_no_tokens(backend, devices):
    dev = devices[backend]
    hidden = torch.randn(0, 16, device=dev, requires_grad=True)
    weight = torch.randn(40, 16, device=dev, requires_grad=True)
    labels = torch.zeros(0, dtype=torch.long, device=dev)
    loss = linear_cross_entropy(hidden, weight, labels, backend=backend)
    loss.backward()
    assert loss.item() == 0.0
    assert weight.grad.abs().max().item() == 0.0
    none = linear_cross_entropy(hidden, weight, labels, backend=backend, reduction="none")
    assert none.shape == (0,)


@pytest.mark.parametrize("backend", FUSED)
def test_label_smoothing_matches_torch_cross_entropy(backend, gen, devices):
    dev = devices[backend]
    hidden, weight, labels = _inputs(gen, device=dev)
    labels[0, 0] = -100
    got = linear_cross_entropy(hidden, weight, labels, label_smoothing=0.3, backend=backend)
    logits = (hidden @ weight.T).reshape(-1, weight.shape[0])
    want = torch.nn.functional.cross_entropy(logits, labels.reshape(-1), label_smoothing=0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_scale_and_divisor_are_applied_before_the_softcap(gen):
    hidden, weight, labels = _inputs(gen)
    got = linear_cross_entropy(
        hidden, weight, labels, logit_scale=3.0, logit_divisor=2.0, softcap=1.0, backend="chunked"
    )
    z = torch.tanh((hidden @ weight.T) * 3.0 / 2.0)
    want = torch.nn.functional.cross_entropy(z.reshape(-1, 90), labels.reshape(-1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not math.isclose(got.item(), _ref(hidden, weight, labels).item(), rel_tol=1e-3)


def test_fp16_gradients_keep_the_input_dtype(gen):
    hidden, weight, labels = _inputs(gen, dtype=torch.float16)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    loss = linear_cross_entropy(h, w, labels, backend="chunked")
    loss.backward()
    assert loss.dtype == torch.float32
    assert h.grad.dtype == torch.float16
    assert w.grad.dtype == torch.float16


@pytest.mark.parametrize("backend", FUSED)
def test_grad_transform_without_vmap(backend, gen, devices):
    dev = devices[backend]
    hidden, weight, labels = _inputs(gen, b=1, device=dev)

    def loss(h, w):
        return linear_cross_entropy(h, w, labels[0], backend=backend, logit_scale=0.5)

    got = torch.func.grad(loss, argnums=(0, 1))(hidden[0], weight)
    want = torch.func.grad(lambda h, w: _ref(h, w, labels[0], logit_scale=0.5), argnums=(0, 1))(
        hidden[0], weight
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("chunk", [True, 32])
def test_grad_of_a_vmapped_sum_adds_the_examples(chunk, gen):
    hidden, weight, labels = _inputs(gen)
    labels[2] = -100

    def total(w):
        per = vmap(lambda h, y: linear_cross_entropy(h, w, y, backend="chunked", chunk_size=chunk))(
            hidden, labels
        )
        return (per * torch.tensor([1.0, -2.0, 3.0])).sum()

    got = torch.func.grad(total)(weight)
    w = weight.clone().requires_grad_(True)
    want_loss = sum(c * _ref(hidden[b], w, labels[b]) for b, c in enumerate((1.0, -2.0, 3.0)))
    (want,) = torch.autograd.grad(want_loss, w)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("chunk", [True, 32])
def test_backward_twice_through_a_retained_graph(chunk, gen):
    hidden, weight, labels = _inputs(gen)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    loss = linear_cross_entropy(h, w, labels, backend="chunked", chunk_size=chunk) * 3.0
    loss.backward(retain_graph=True)
    loss.backward()
    h2 = hidden.clone().requires_grad_(True)
    w2 = weight.clone().requires_grad_(True)
    (_ref(h2, w2, labels) * 6.0).backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("reduction", ["per_example", "sum", "none"])
def test_weight_gradient_of_every_reduction(reduction, gen):
    hidden, weight, labels = _inputs(gen)
    labels[1, 3:] = -100
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    out = linear_cross_entropy(h, w, labels, backend="chunked", reduction=reduction)
    r = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad((out * r).sum(), (h, w))
    want = torch.autograd.grad((_ref(h, w, labels, reduction=reduction) * r).sum(), (h, w))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)
