"""engine="auto" decides from the model a BatchedLoss holds, not from how frozen weights arrive."""

from __future__ import annotations

import logging

import pytest
import torch

from opake.core import testing
from opake.dpsgd.bookkeeping import BatchedLoss
from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional


def _adapter_model():
    """A frozen body (4,160 numbers) and a small trainable head (65): an adapter's proportions."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    for p in model[0].parameters():
        p.requires_grad_(False)
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    x = torch.randn(6, 64)
    return fmodel, trainable, frozen, x


def _closure_loss(fmodel, frozen):
    def losses(p, x):
        return fmodel((p, frozen), x)[:, 0].square()

    return BatchedLoss(losses, fmodel)


def _argument_loss(fmodel):
    def losses(p, frozen, x):
        return fmodel((p, frozen), x)[:, 0].square()

    return BatchedLoss(losses, fmodel)


def test_closure_and_argument_get_the_same_engine_and_the_same_sum(caplog):
    fmodel, trainable, frozen, x = _adapter_model()
    caplog.set_level(logging.INFO, logger="opake.core")
    closed, state = clipped_grad(_closure_loss(fmodel, frozen), clipping_norm=0.3)
    passed, _ = clipped_grad(_argument_loss(fmodel), clipping_norm=0.3, batch_argnums=2)
    # the small trainable part is seen both ways: from the model and from the arguments
    assert closed._prefer_expanded((trainable, x), differentiable=False)
    assert passed._prefer_expanded((trainable, frozen, x), differentiable=False)
    a, _ = closed(trainable, x, state=state)
    b, _ = passed(trainable, frozen, x, state=state)
    assert closed.engine == passed.engine == "bookkeeping"
    assert "small part of the model" in closed.engine_reason
    logged = [r.getMessage() for r in caplog.records if "engine='auto'" in r.getMessage()]
    assert len(logged) == 2  # one line per grad_fn, not one per call
    assert all("bookkeeping engine" in m for m in logged)

    def one(p, xi):
        return fmodel((p, frozen), xi[None])[0, 0].square()

    want = testing.reference_clipped_grad(one, (trainable, x), clipping_norm=0.3)
    testing.assert_grads_close(a, want, rtol=1e-5)
    testing.assert_grads_close(b, want, rtol=1e-5)


def test_full_model_is_not_small():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    fmodel, params = make_functional(model)
    loss = BatchedLoss(lambda p, x: fmodel(p, x)[:, 0].square(), fmodel)
    grad_fn, state = clipped_grad(loss, clipping_norm=1.0)
    x = torch.randn(4, 8)
    assert not grad_fn._prefer_expanded((params, x), differentiable=False)
    grad_fn(params, x, state=state)
    assert grad_fn.engine == "bookkeeping"
    assert "small part" not in grad_fn.engine_reason


def test_one_example_loss_takes_the_expanded_vmap_route(caplog):
    fmodel, trainable, frozen, x = _adapter_model()
    caplog.set_level(logging.INFO, logger="opake.core")

    def one(p, frozen, xi):
        return fmodel((p, frozen), xi[None])[0, 0].square()

    grad_fn, state = clipped_grad(one, clipping_norm=0.3, batch_argnums=2)
    assert grad_fn._prefer_expanded((trainable, frozen, x), differentiable=False)
    grads, _ = grad_fn(trainable, frozen, x, state=state)
    assert grad_fn.engine == "vmap"
    assert any("vmap engine" in r.getMessage() for r in caplog.records)
    want = testing.reference_clipped_grad(
        one, (trainable, frozen, x), clipping_norm=0.3, batch_argnums=2
    )
    testing.assert_grads_close(grads, want, rtol=1e-5)


@pytest.mark.parametrize("method", ["vmap", "bookkeeping"])
def test_explicit_methods_are_not_logged_as_choices(method, caplog):
    fmodel, trainable, frozen, x = _adapter_model()
    caplog.set_level(logging.INFO, logger="opake.core")
    grad_fn, state = clipped_grad(_closure_loss(fmodel, frozen), clipping_norm=0.3, engine=method)
    grad_fn(trainable, x, state=state)
    assert grad_fn.engine == method
    assert not [r for r in caplog.records if "engine='auto'" in r.getMessage()]


def test_the_expanded_route_falling_back_is_logged(caplog):
    caplog.set_level(logging.INFO, logger="opake.core")

    def picky_loss(params, frozen, v):  # refuses batched parameters (no batching rule)
        if torch._C._functorch.is_batchedtensor(params["w"]):
            raise RuntimeError("no batching rule for a batched weight")
        return (params["w"] * v).sum() + 0 * frozen.sum()

    grad_fn, state = clipped_grad(picky_loss, clipping_norm=10.0, batch_argnums=2)
    args = ({"w": torch.zeros(2)}, torch.zeros(100), torch.ones(3, 2))
    grad_fn(*args, state=state)
    grad_fn(*args, state=state)
    logged = [r.getMessage() for r in caplog.records if "expanded forward failed" in r.getMessage()]
    assert len(logged) == 1
    assert "no batching rule" in logged[0]
