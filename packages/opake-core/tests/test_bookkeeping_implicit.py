"""Book-keeping through ``implicit_use``: a parameter read without calling its layer (what the
loss-only head does with ``lm_head.weight``), its per-example gradients returned by the use as
an ``ImplicitGrad`` operator or as a tensor — equal to the vmap engine and the per-example loop,
tied (cross term with an embedding) or not, and loud on misuse."""

from __future__ import annotations

import pytest
import torch

from opake.core import testing
from opake.core.errors import OperationError
from opake.dpsgd.bookkeeping import BatchedLoss, ImplicitGrad, implicit_use
from opake.dpsgd.bookkeeping._certify import certify, inner
from opake.dpsgd.bookkeeping._pieces import Dense, Implicit, OuterSum
from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional

V, D, B, T = 11, 6, 4, 5
#: the test's operator proves no bounds: outside the clipping proof, used only when trusted
TRUST = ("_DenseImplicit",)


class _DenseImplicit:
    """An ``ImplicitGrad`` backed by the materialised per-example gradients ``[B, R, C]``."""

    def __init__(self, g: torch.Tensor) -> None:
        self.g = g.float()

    @property
    def batch(self) -> int:
        return int(self.g.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.g.shape[1]), int(self.g.shape[2])

    def sq_norms(self):
        return self.g.square().sum((1, 2)), None

    def weighted_sum(self, weights, keep=None):
        w = weights if keep is None else torch.where(keep, weights, 0.0)
        g = self.g if keep is None else torch.where(keep[:, None, None], self.g, 0.0)
        return torch.einsum("b,brc->rc", w, g), None

    def inner_outer(self, a, b):
        if a.dtype == torch.int64:
            a = torch.nn.functional.one_hot(a, self.shape[0]).float()
        return torch.einsum("brc,bsr,bsc->b", self.g, a, b.float())

    def abs_norms(self):
        return self.g.double().square().sum((1, 2)).sqrt()

    def example_rows(self, index, start, stop):
        return self.g[index, start:stop].double()


class _Toy(torch.nn.Module):
    """Embedding → tanh(Linear) → a head read *implicitly* (never called as a module)."""

    def __init__(self, *, tied: bool, form: str) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.body = torch.nn.Linear(D, D)
        self.head = torch.nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.form = form

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(self.emb(ids)))  # [B, T, D]
        weight = self.head.weight
        use = implicit_use(self.head)
        if use is None:
            return ((h @ weight.T) ** 2).mean(dim=(1, 2))
        assert use.params["weight"] is weight
        out = h @ weight.detach().T
        hd = h.detach()

        def build(g: torch.Tensor) -> dict[str, object]:
            per_example = torch.einsum("btv,btd->bvd", g, hd)
            if self.form == "tensor":
                return {"weight": per_example}
            return {"weight": _DenseImplicit(per_example)}

        return (use.tap(out, build) ** 2).mean(dim=(1, 2))


def _case(model):
    fmodel, params = make_functional(model)
    loss = BatchedLoss(fmodel, fmodel)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3))
    return loss, params, ids


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("form", ["implicit", "tensor"])
def test_implicit_use_equals_vmap_and_the_loop(tied, form):
    torch.manual_seed(0)
    model = _Toy(tied=tied, form=form)
    loss, params, ids = _case(model)
    per_example = loss.per_example(batch_argnums=(1,), has_aux=False)
    expected = testing.reference_clipped_grad(
        per_example, (params, ids), clipping_norm=0.3, batch_argnums=(1,)
    )
    results = {}
    for method in ("bookkeeping", "vmap"):
        grad_fn, state = clipped_grad(
            loss, clipping_norm=0.3, batch_argnums=(1,), engine=method, trusted_rules=TRUST
        )
        results[method], _ = grad_fn(params, ids, state=state)
        assert grad_fn.engine == method
    testing.assert_grads_close(results["bookkeeping"], expected, rtol=1e-5, atol=1e-7)
    testing.assert_grads_close(results["bookkeeping"], results["vmap"], rtol=1e-5, atol=1e-7)


def test_the_protocol_is_runtime_checkable():
    assert isinstance(_DenseImplicit(torch.zeros(1, 2, 3)), ImplicitGrad)
    assert not isinstance(torch.zeros(1), ImplicitGrad)


def test_outside_a_recording_or_for_a_frozen_layer_there_is_no_use():
    model = _Toy(tied=False, form="implicit")
    assert implicit_use(model.head) is None
    model.head.weight.requires_grad_(False)
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    assert "head.weight" not in trainable

    seen = []

    def losses(t, f, ids):
        seen.append(implicit_use(model.head))
        return fmodel((t, f), ids)

    grad_fn, state = clipped_grad(
        BatchedLoss(losses, fmodel), clipping_norm=1.0, batch_argnums=(2,), engine="bookkeeping"
    )
    ids = torch.randint(0, V, (B, T))
    grad_fn(trainable, frozen, ids, state=state)
    assert seen
    assert all(use is None for use in seen)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda g, h: {}, r"built \[\]; expected per-example gradients for exactly \['weight'\]"),
        (lambda g, h: {"weight": torch.zeros(3, V, D)}, r"expected an ImplicitGrad or per-example"),
        (lambda g, h: {"weight": _DenseImplicit(torch.zeros(B, V, D + 1))}, r"implicit gradients"),
    ],
)
def test_a_bad_build_is_named(build, match):
    class Bad(_Toy):
        def forward(self, ids):
            h = torch.tanh(self.body(self.emb(ids)))
            use = implicit_use(self.head)
            if use is None:
                return ((h @ self.head.weight.T) ** 2).mean(dim=(1, 2))
            out = use.tap(h @ self.head.weight.detach().T, lambda g: build(g, h))
            return (out**2).mean(dim=(1, 2))

    loss, params, ids = _case(Bad(tied=False, form="implicit"))
    grad_fn, state = clipped_grad(
        loss, clipping_norm=1.0, batch_argnums=(1,), engine="bookkeeping", trusted_rules=TRUST
    )
    with pytest.raises(OperationError, match=match):
        grad_fn(params, ids, state=state)


def test_tapping_after_the_recording_ended_and_a_stale_weight_are_loud():
    kept = []

    class Late(_Toy):
        def forward(self, ids):
            use = implicit_use(self.head)
            if use is not None:
                kept.append(use)
            return super().forward(ids)

    loss, params, ids = _case(Late(tied=False, form="implicit"))
    grad_fn, state = clipped_grad(
        loss, clipping_norm=1.0, batch_argnums=(1,), engine="bookkeeping", trusted_rules=TRUST
    )
    grad_fn(params, ids, state=state)
    assert kept
    with pytest.raises(OperationError, match="after its recording ended"):
        kept[0].tap(torch.zeros(1), lambda g: {})

    class Stale(_Toy):
        def forward(self, ids):
            self.head.weight = torch.nn.Parameter(torch.zeros(V, D))  # not the differentiated one
            return super().forward(ids)

    loss, params, ids = _case(Stale(tied=False, form="implicit"))
    grad_fn, state = clipped_grad(
        loss, clipping_norm=1.0, batch_argnums=(1,), engine="bookkeeping", trusted_rules=TRUST
    )
    with pytest.raises(OperationError, match=r"not the differentiated tensor 'head\.weight'"):
        grad_fn(params, ids, state=state)


def _inner(u, v):
    return inner(u, v, certify(u, trusted=True), certify(v, trusted=True), trusted=True)


def test_an_implicit_piece_has_no_cross_term_with_a_dense_use():
    op = _DenseImplicit(torch.randn(2, 3, 4))
    with pytest.raises(OperationError, match="no rule forms their cross term"):
        _inner(Implicit(op), Dense(torch.randn(2, 3, 4)))
    with pytest.raises(OperationError, match=r"OuterSum \(3, 5\)"):
        _inner(Implicit(op), OuterSum(torch.randn(2, 1, 3), torch.randn(2, 1, 5)))
    ids = torch.tensor([[0, 2], [1, 1]])
    b = torch.randn(2, 2, 4)
    want = torch.einsum("brc,bsr,bsc->b", op.g, torch.nn.functional.one_hot(ids, 3).float(), b)
    got, _ = _inner(OuterSum(ids, b, rows=3), Implicit(op))
    torch.testing.assert_close(got, want.double())


def test_an_operator_outside_the_proof_needs_trust(caplog):
    """Without the trust list, the test's uncertified operator is refused: "auto" falls back to
    the vmap engine, saying why, and "bookkeeping" raises."""
    loss, params, ids = _case(_Toy(tied=False, form="implicit"))
    grad_fn, state = clipped_grad(loss, clipping_norm=0.3, batch_argnums=(1,), engine="auto")
    with caplog.at_level("WARNING", logger="opake.core"):
        grad_fn(params, ids, state=state)
    assert grad_fn.engine == "vmap"
    assert "outside the clipping proof" in caplog.text
    strict, state = clipped_grad(loss, clipping_norm=0.3, batch_argnums=(1,), engine="bookkeeping")
    with pytest.raises(OperationError, match="outside the clipping proof"):
        strict(params, ids, state=state)
