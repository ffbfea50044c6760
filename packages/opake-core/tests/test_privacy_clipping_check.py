"""The book-keeping engine's check against per-example autograd cannot pass vacuously.

It compares an example with a non-zero gradient (never a padding-only or zero-weight one),
again on every new structure (shapes, differentiated set) and periodically; when no example
can be compared (every gradient zero or not finite) the call runs on the vmap engine.
"""

from __future__ import annotations

import logging
import math

import torch

from opake.core import testing
from opake.dpsgd.bookkeeping import BatchedLoss
from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional

F = torch.nn.functional
BOUND = 1.0 + 1e-12  # the oracle's own fp64 rounding: the bound is proven


def _norm(grads) -> float:
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))


def _contribution(grad_fn, state, args, batch, i):
    mask = torch.zeros(batch, dtype=torch.bool)
    mask[i] = True
    grads, _ = grad_fn(*args, state=state, example_mask=mask)
    return _norm(grads)


def _tied_head_case():
    """An embedding whose weight is also read, by hand, as the output projection."""
    torch.manual_seed(0)
    vocab, hidden = 32, 16
    model = torch.nn.ModuleDict(
        {"emb": torch.nn.Embedding(vocab, hidden), "mix": torch.nn.Linear(hidden, hidden)}
    )
    _, params = make_functional(model)

    def losses(p, ids, labels):
        e = torch.func.functional_call(model["emb"], {"weight": p["emb.weight"]}, (ids,))
        mix = {"weight": p["mix.weight"], "bias": p["mix.bias"]}
        h = torch.tanh(torch.func.functional_call(model["mix"], mix, (e,)))
        logits = F.linear(h, p["emb.weight"])  # hand-tied head: no layer reads it
        per_token = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
        count = (labels != -100).sum(dim=1).clamp(min=1)
        return per_token.sum(dim=1) / count

    return BatchedLoss(losses, model), params, vocab


def test_tied_head_with_padding_first_example_is_exact():
    loss, params, vocab = _tied_head_case()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (4, 6), generator=gen)
    labels = torch.randint(0, vocab, (4, 6), generator=gen)
    labels[0] = -100  # example 0: padding only, zero gradient
    grad_fn, state = clipped_grad(loss, clipping_norm=10.0, batch_argnums=(1, 2))
    grads, _ = grad_fn(params, ids, labels, state=state)
    one = loss.per_example(batch_argnums=(1, 2), has_aux=False)
    want = testing.reference_clipped_grad(
        one, (params, ids, labels), clipping_norm=10.0, batch_argnums=(1, 2)
    )
    testing.assert_grads_close(grads, want, rtol=1e-4)
    assert grad_fn.engine == "vmap"


def _time_major_case(batch: int):
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    fmodel, params = make_functional(layer)

    def losses(p, x, y, w):
        h = fmodel(p, x.transpose(0, 1)).transpose(0, 1)  # the layer sees [T, B, d]
        # the first position carries no loss (like the unlabelled first token of a causal LM)
        return w * ((h - y)[:, 1:] ** 2).sum(dim=(1, 2))

    return BatchedLoss(losses, fmodel), params


def test_time_major_model_with_zero_weight_first_example(caplog):
    batch = steps = 4
    loss, params = _time_major_case(batch)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(batch, steps, 8, generator=gen) * 3
    y = torch.randn(batch, steps, 8, generator=gen) * 3
    w = torch.tensor([0.0, 1.0, 1.0, 1.0])  # example 0 carries no weight: zero gradient
    grad_fn, state = clipped_grad(loss, clipping_norm=1.0, batch_argnums=(1, 2, 3))
    args = (params, x, y, w)
    with caplog.at_level(logging.INFO, logger="opake.core"):
        grads, _ = grad_fn(*args, state=state)
    one = loss.per_example(batch_argnums=(1, 2, 3), has_aux=False)
    want = testing.reference_clipped_grad(one, args, clipping_norm=1.0, batch_argnums=(1, 2, 3))
    testing.assert_grads_close(grads, want, rtol=1e-4)
    assert grad_fn.engine == "vmap"
    for i in range(batch):
        assert _contribution(grad_fn, state, args, batch, i) <= BOUND, i
    assert "book-keeping" in caplog.text


def test_an_all_zero_batch_is_never_used_unchecked(caplog):
    loss, params = _time_major_case(4)
    x = torch.randn(4, 4, 8)
    y = torch.randn(4, 4, 8)
    grad_fn, state = clipped_grad(
        loss, clipping_norm=1.0, batch_argnums=(1, 2, 3), engine="bookkeeping"
    )
    with caplog.at_level(logging.INFO, logger="opake.core"):
        grads, _ = grad_fn(params, x, y, torch.zeros(4), state=state)
    assert grad_fn.engine == "vmap"
    assert "inconclusive" in caplog.text
    assert all(not bool(g.any()) for g in grads.values())


def test_a_new_shape_is_checked_again():
    """Examples are mixed only for the second sequence length: the check must run again."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    fmodel, params = make_functional(layer)

    def losses(p, x, y):
        if x.shape[1] == x.shape[0]:  # time-major for this shape only
            h = fmodel(p, x.transpose(0, 1)).transpose(0, 1)
        else:
            h = fmodel(p, x)
        return ((h - y) ** 2).sum(dim=(1, 2))

    loss = BatchedLoss(losses, fmodel)
    grad_fn, state = clipped_grad(loss, clipping_norm=1.0, batch_argnums=(1, 2))
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(4, 3, 8, generator=gen), torch.randn(4, 3, 8, generator=gen)
    grad_fn(params, x, y, state=state)
    assert grad_fn.engine == "bookkeeping"
    x, y = torch.randn(4, 4, 8, generator=gen), torch.randn(4, 4, 8, generator=gen)
    grads, _ = grad_fn(params, x, y, state=state)
    assert grad_fn.engine == "vmap"
    one = loss.per_example(batch_argnums=(1, 2), has_aux=False)
    want = testing.reference_clipped_grad(
        one, (params, x, y), clipping_norm=1.0, batch_argnums=(1, 2)
    )
    testing.assert_grads_close(grads, want, rtol=1e-4)
