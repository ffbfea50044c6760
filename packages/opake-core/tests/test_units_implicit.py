"""Privacy units and operators that hold per-example gradients implicitly (``Implicit`` pieces).

An operator that only computes norms and sums of its own examples cannot sum a unit's rows:
``engine="auto"`` clips such unit calls on the vmap engine (and remembers it), an explicit
``engine="bookkeeping"`` raises, calls without units keep book-keeping. A first-party certified
operator that exposes the ``OuterSum`` it certifies itself from (``outer_view()``) is regrouped
like any ``OuterSum``: inside the proof, equal to the per-unit loop.
"""

from __future__ import annotations

import pytest
import torch

from opake.core import testing
from opake.core.errors import ConfigurationError
from opake.dpsgd.bookkeeping import BatchedLoss, implicit_use
from opake.dpsgd.bookkeeping._certify import certify, certify_inner
from opake.dpsgd.bookkeeping._pieces import OuterSum, example_rows, materialise, weighted_sum
from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional

V, D, T = 11, 6, 5
IDS = torch.tensor([4, 9, 4, 9, 4, 2])


class _Outer:
    """An ``ImplicitGrad`` over the ``OuterSum`` ``(g, h)``: the head's per-example gradient."""

    def __init__(self, g: torch.Tensor, h: torch.Tensor) -> None:
        self.view = OuterSum(g.float(), h.float())

    @property
    def batch(self) -> int:
        return int(self.view.b.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return self.view.shape

    def sq_norms(self):
        return materialise(self.view).square().sum((1, 2)), None

    def weighted_sum(self, weights, keep=None):
        return weighted_sum(self.view, weights, keep), None

    def inner_outer(self, a, b):
        return certify_inner(self.view, OuterSum(a, b, rows=V if a.dtype == torch.int64 else None))[
            0
        ]

    def abs_norms(self):
        return (self.view.a.double().norm(dim=2) * self.view.b.double().norm(dim=2)).sum(1)

    def example_rows(self, index, start, stop):
        return example_rows(self.view, index, start, stop)


class _Certified(_Outer):
    """A first-party certified operator (its module says so) that offers its ``OuterSum``."""

    __module__ = "opake.dpsgd.test_units_fake"

    def certificate(self):
        return certify(self.view)

    def certified_inner(self, a, b):
        rows = V if a.dtype in (torch.int64, torch.int32) else None
        return certify_inner(self.view, OuterSum(a.long() if rows else a, b, rows=rows))

    def outer_view(self) -> OuterSum:
        return self.view


class _Toy(torch.nn.Module):
    """Embedding → tanh(Linear) → a head read implicitly (as the loss-only head reads it)."""

    def __init__(self, op: type) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.body = torch.nn.Linear(D, D)
        self.head = torch.nn.Linear(D, V, bias=False)
        self.op = op

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(self.emb(ids)))
        weight = self.head.weight
        use = implicit_use(self.head)
        if use is None:
            return ((h @ weight.T) ** 2).mean(dim=(1, 2))
        out = h @ weight.detach().T
        hd = h.detach()
        return (use.tap(out, lambda g: {"weight": self.op(g, hd)}) ** 2).mean(dim=(1, 2))


def _case(op):
    torch.manual_seed(0)
    fmodel, params = make_functional(_Toy(op))
    loss = BatchedLoss(fmodel, fmodel)
    ids = torch.randint(0, V, (len(IDS), T), generator=torch.Generator().manual_seed(3))
    one = loss.per_example(batch_argnums=(1,), has_aux=False)
    grads, _ = testing.per_example_grads_loop(one, (params, ids), batch_argnums=(1,))
    per_unit = []
    for uid in torch.unique(IDS).tolist():
        rows = IDS.eq(uid).nonzero().flatten().tolist()
        per_unit.append({k: sum(grads[i][k].double() for i in rows) for k in params})
    return loss, params, ids, testing.reference_clipped_sum(per_unit, clipping_norm=0.3)


def test_an_operator_that_cannot_sum_units_sends_unit_calls_to_vmap():
    loss, params, ids, want = _case(_Outer)
    grad_fn, state = clipped_grad(
        loss, clipping_norm=0.3, batch_argnums=(1,), trusted_rules=("_Outer",)
    )
    got, _ = grad_fn(params, ids, state=state, units=IDS)
    assert grad_fn.engine == "vmap"
    assert "per privacy unit" in grad_fn.engine_reason
    testing.assert_grads_close(got, want, rtol=1e-5, atol=1e-7)
    got, _ = grad_fn(params, ids, state=state, units=IDS)  # remembered: straight to vmap
    assert grad_fn.engine == "vmap"
    grad_fn(params, ids, state=state)  # without units the operator is fine
    assert grad_fn.engine == "bookkeeping"
    strict, state = clipped_grad(
        loss, clipping_norm=0.3, batch_argnums=(1,), engine="bookkeeping", trusted_rules=("_Outer",)
    )
    with pytest.raises(ConfigurationError, match="per privacy unit"):
        strict(params, ids, state=state, units=IDS)


@pytest.mark.parametrize("microbatch_size", [None, 2])
def test_a_certified_operator_with_its_outer_sum_is_regrouped(microbatch_size):
    loss, params, ids, want = _case(_Certified)
    grad_fn, state = clipped_grad(
        loss,
        clipping_norm=0.3,
        batch_argnums=(1,),
        engine="bookkeeping",
        microbatch_size=microbatch_size,
    )
    got, _ = grad_fn(params, ids, state=state, units=IDS)
    assert grad_fn.engine == "bookkeeping"
    testing.assert_grads_close(got, want, rtol=1e-5, atol=1e-7)
    for uid in torch.unique(IDS).tolist():  # each unit alone within C (exactly measured)
        alone, _ = grad_fn(params, ids, state=state, units=IDS, example_mask=IDS.eq(uid))
        assert testing.exact_norm(alone) <= 0.3 * (1 + testing.TOLERANCE)
