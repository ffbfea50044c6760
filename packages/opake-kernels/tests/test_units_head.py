"""The loss-only LM head under privacy units (``grad_fn(..., units=ids)``).

``LinearCEExampleGrads.outer_view()`` hands the book-keeping engine the ``OuterSum``
``(u, g ⊙ h)`` its certificate is proved from, which the engine regroups per unit like any
``OuterSum`` (docs/guide/clipping-proof.md, section 8): a patched causal LM's unit calls stay on
book-keeping, equal the vmap engine and the per-unit autograd loop, and each unit alone adds at
most ``C`` (exact fp64 norm of what the sum receives) under huge, tiny and cancelling rows.
"""

from __future__ import annotations

import math

import pytest
import torch

from opake.core import testing
from opake.core.errors import OperationError
from opake.dpsgd.bookkeeping import BatchedLoss, certify_piece
from opake.dpsgd.bookkeeping._pieces import materialise
from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional
from opake.kernels import linear_cross_entropy
from opake.kernels.chunked import linear_cross_entropy_recorded

pytest.importorskip("transformers")

# unit 3 has 3 rows (more than a microbatch of 2: its own chunk), rows scattered
UNITS = torch.tensor([3, 1, 3, 2, 1, 3])
V, T = 64, 8


def _per_unit(per_row, ids, mask=None):
    """Each unit's gradient (ascending id): its real rows' gradients summed in fp64."""
    out = []
    for unit in torch.unique(ids).tolist():
        rows = [i for i in range(len(ids)) if ids[i] == unit and (mask is None or mask[i])]
        out.append({k: sum(per_row[i][k].double() for i in rows) for k in per_row[0]})
    return out


def _norm(grads):
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))


def _lm(craft=None):
    """A tiny GPT-2 (head tied to ``wte``) with the loss-only head: ``BatchedLoss``, params."""
    from opake.patches import apply_model_patches

    model = testing.tiny_gpt2(n_embd=16, n_layer=1, n_head=2, vocab_size=V, n_positions=16)
    if craft is not None:
        with torch.no_grad():
            craft(model)
    apply_model_patches(model, chunked_linear_cross_entropy=True)
    fmodel, params = make_functional(model)

    def losses(p, ids, labels):
        out = fmodel(
            p, input_ids=ids, labels=labels, loss_only=True, per_example_loss=True, use_cache=False
        )
        return out.loss

    return BatchedLoss(losses, fmodel), params


def _batch(seed=4):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (len(UNITS), T), generator=gen)
    labels = ids.clone()
    labels[1, 5:] = -100
    return ids, labels


def test_outer_view_is_the_kept_outer_sum():
    """``a`` is the kept logit gradients (a view, no copy), ``b = g ⊙ h``; the pair's per-example
    gradient is the head's, and its certificate is the operator's own."""
    gen = torch.Generator().manual_seed(0)
    b, t, h = 3, 5, 8
    hidden = torch.randn(b, t, h, generator=gen, requires_grad=True)
    weight = torch.randn(V, h, generator=gen) * h**-0.5
    labels = torch.randint(0, V, (b, t), generator=gen)
    labels[2, 3:] = -100
    grads = torch.rand(b, t, generator=gen) + 0.5
    tok, record = linear_cross_entropy_recorded(hidden, weight, labels, keep_logit_grads=True)
    (tok * grads).sum().backward()
    op = record.example_grads(grads)
    view = op.outer_view()
    assert record.kept is not None
    assert record.kept.u is not None
    assert view.a.data_ptr() == record.kept.u.data_ptr()
    assert view.shape == (V, h)
    assert tuple(view.a.shape) == (b, t, V)
    want = []
    for i in range(b):
        w = weight.double().clone().requires_grad_(True)
        loss = linear_cross_entropy(hidden[i].detach().double(), w, labels[i], reduction="none")
        (gw,) = torch.autograd.grad((loss * grads[i].double()).sum(), w)
        want.append(gw)
    torch.testing.assert_close(
        materialise(view, wide=True), torch.stack(want), rtol=1e-5, atol=1e-7
    )
    mine, generic = op.certificate(), certify_piece(view)
    assert torch.equal(mine.sq, generic.sq)
    assert torch.equal(mine.err, generic.err)
    _, unkept = linear_cross_entropy_recorded(hidden, weight, labels, keep_logit_grads=False)
    with pytest.raises(OperationError, match="not kept"):
        unkept.example_grads(grads).outer_view()


@pytest.mark.parametrize("microbatch_size", [None, 2])
def test_units_stay_on_bookkeeping_and_equal_the_per_unit_loop(microbatch_size):
    loss, params = _lm()
    ids, labels = _batch()
    args = (params, ids, labels)
    one = loss.per_example(batch_argnums=(1, 2), has_aux=False)
    per_row, _ = testing.per_example_grads_loop(one, args, batch_argnums=(1, 2))
    units = _per_unit(per_row, UNITS)
    norms = sorted(_norm(g) for g in units)
    clip = 0.5 * (norms[0] + norms[1])  # one unit of three clipped... and two not
    want = testing.reference_clipped_sum(units, clipping_norm=clip)
    got = {}
    for engine in ("bookkeeping", "vmap"):
        grad_fn, state = clipped_grad(
            loss,
            clipping_norm=clip,
            batch_argnums=(1, 2),
            engine=engine,
            microbatch_size=microbatch_size,
            return_aux=True,
        )
        (got[engine], aux), _ = grad_fn(*args, state=state, units=UNITS)
        assert grad_fn.engine == engine, grad_fn.engine_reason
        testing.assert_grads_close(got[engine], want, rtol=1e-5)
        exact = torch.tensor([_norm(g) for g in units], dtype=torch.float64)
        torch.testing.assert_close(aux.grad_norms.double(), exact, rtol=1e-4, atol=0)
    testing.assert_grads_close(got["bookkeeping"], got["vmap"], rtol=1e-5)


def test_auto_keeps_bookkeeping_for_units():
    loss, params = _lm()
    grad_fn, state = clipped_grad(loss, clipping_norm=0.1, batch_argnums=(1, 2))
    grad_fn(params, *_batch(), state=state, units=UNITS)
    assert grad_fn.engine == "bookkeeping", grad_fn.engine_reason


def test_unkept_logit_grads_fall_back_as_without_units(monkeypatch):
    """Logit gradients not kept (they did not fit): no ``OuterSum`` to certify, with or without
    units; ``"auto"`` then clips on the vmap engine, saying why."""
    import opake.kernels.chunked._recorded as recorded

    monkeypatch.setattr(recorded, "keeps_logit_grads", lambda *a, **k: None)
    loss, params = _lm()
    grad_fn, state = clipped_grad(loss, clipping_norm=0.1, batch_argnums=(1, 2))
    grad_fn(params, *_batch(), state=state, units=UNITS)
    assert grad_fn.engine == "vmap"
    assert "not kept" in str(grad_fn.engine_reason)


def _huge(model):
    model.transformer.ln_f.weight.mul_(1e4)  # logits ~1e4: a saturated softmax


def _tiny(model):
    model.transformer.ln_f.weight.mul_(1e-22)  # hidden ~1e-22: their Gram entries underflow
    model.transformer.ln_f.bias.zero_()


def _cancel(model):
    """Every hidden state is ``ln_f.bias``; head rows 0 and 1 equal and aligned with it (each
    about half the probability). A unit whose rows read the same ids, one labelled 0 and the
    other 1, has per-row gradients that cancel up to rounding: its true gradient is tiny."""
    ln = model.transformer.ln_f
    ln.weight.zero_()
    ln.bias.copy_(torch.randn(ln.bias.shape, generator=torch.Generator().manual_seed(5)))
    wte = model.transformer.wte.weight
    wte[0] = wte[1] = 50.0 * ln.bias / ln.bias.norm()


CASES = {"plain": None, "huge": _huge, "tiny": _tiny, "cancel": _cancel}


@pytest.mark.parametrize("clip", [1e-6, 2e-4, 1.0])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_unit_alone_is_within_the_bound(case, clip):
    loss, params = _lm(CASES[case])
    ids, labels = _batch(seed=7)
    if case == "cancel":  # units 3 and 1: the same ids in each row, labels 0 and 1
        for rows in ([0, 2, 5], [1, 4]):
            ids[rows] = ids[rows[0]].clone()
            labels[rows] = torch.tensor([[0], [1], [0]][: len(rows)]).expand(-1, T)
        labels[5] = -100  # unit 3: one row of 0s, one of 1s, one ignored
    grad_fn, state = clipped_grad(
        loss, clipping_norm=clip, batch_argnums=(1, 2), engine="bookkeeping"
    )
    grad_fn(params, *_batch(), state=state, units=UNITS)  # the first-call check, benign data
    for unit in torch.unique(UNITS).tolist():
        alone, _ = grad_fn(
            params, ids, labels, state=state, units=UNITS, example_mask=UNITS.eq(unit)
        )
        assert grad_fn.engine == "bookkeeping"
        norm = testing.exact_norm(alone)
        assert norm <= clip * (1 + testing.TOLERANCE), (case, unit, norm / clip)
