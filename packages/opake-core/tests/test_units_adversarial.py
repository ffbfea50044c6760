"""Adversarial search: removing one privacy unit moves the clipped sum by at most its bound.

Hypothesis searches (guided by ``target`` towards the largest contribution) over batches of
units of one to four rows, scattered over the batch under arbitrary ids, whose rows follow
the patterns built to break fp32 norms (:data:`opake.core.testing.PATTERNS`: repeated,
alternating, cancelling tokens, zero and non-finite rows, magnitudes 1e-30..1e30) — and
units whose rows cancel each other (a row and its negation up to a tiny residual: the unit's
gradient is almost zero while its rows are huge). For every book-keeping rule kind and both
engines, with fixed, group, AUTO-S and adaptive clipping:

- each unit's contribution, isolated with ``example_mask`` (its rows kept), has an exact norm
  (:func:`opake.core.testing.exact_norm`) within the bound, with no tolerance beyond the
  oracle's own fp64 rounding;
- the batch without that unit (its rows removed) differs from the whole batch's sum by at most
  the bound, up to the fp32 rounding of the other units' sum (which no DP-SGD library covers);
- for moderate inputs, the sum equals the per-unit loop of plain autograd in fp64.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, target
from hypothesis import strategies as st

from opake.core import testing
from opake.dpsgd.bookkeeping import BatchedLoss
from opake.dpsgd.clipping import AdaptiveClipping, AutoSClipping, GroupClipping, clipped_grad
from opake.functional import make_functional

TOL = testing.TOLERANCE  # the oracle's own fp64 rounding: the bound is proven, not modelled
PATTERNS = testing.PATTERNS
# the example count and derandomisation come from the repo's profiles (tests/hypothesis_profiles)
SEARCH = settings(suppress_health_check=[HealthCheck.data_too_large])


class _Tied(torch.nn.Module):
    """An embedding whose weight is also the output projection (GPT-2's wte / lm_head)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(12, 8, padding_idx=0)
        self.head = torch.nn.Linear(8, 12, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))


class _Scale(torch.nn.Module):
    """A leaf layer without a closed-form rule (the per-layer fallback: Dense pieces)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


# name: (module, tokens, input width or vocabulary, output width, tokens per row)
RULES = {
    "linear-ghost": (lambda: torch.nn.Linear(16, 16), False, 16, 16, 3),  # Gram route
    "linear-materialised": (lambda: torch.nn.Linear(4, 3), False, 4, 3, 12),
    "layer_norm": (lambda: torch.nn.LayerNorm(8), False, 8, 8, 4),
    "per_layer": (_Scale, False, 8, 8, 4),
    "tied": (_Tied, True, 12, 12, 5),  # embedding (indexed) + head, and their cross term
}

ROW = st.tuples(
    st.sampled_from(PATTERNS),  # inputs
    st.sampled_from(PATTERNS),  # output gradients
    st.floats(-30.0, 30.0),  # log10 magnitude of the inputs
    st.floats(-30.0, 30.0),  # log10 magnitude of the output gradients
    st.floats(-12.0, 0.0),  # log10 of the residual left after cancellation
)
# a unit: its rows, and whether a last row cancels its first (same input, negated gradient)
UNIT = st.tuples(st.lists(ROW, min_size=1, max_size=3), st.booleans())


def _case(name):
    torch.manual_seed(0)
    build, tokens, width, out, steps = RULES[name]
    fmodel, params = make_functional(build())

    def losses(p, x, y):
        return (fmodel(p, x) * y).sum(dim=(1, 2))

    return BatchedLoss(losses, fmodel), params, (tokens, width, out, steps)


def _batch(shape, units, seed):
    """Rows of every unit, then shuffled; returns ``x, y, ids`` (ids arbitrary and sparse)."""
    tokens, width, out, steps = shape
    gen = torch.Generator().manual_seed(seed)
    rows = [row for unit_rows, _ in units for row in unit_rows]
    x, y = testing.adversarial_batch(
        rows, gen, tokens=tokens, width=width, steps=steps, out_shape=(steps, out)
    )
    ids, extra_x, extra_y, start = [], [], [], 0
    for u, (unit_rows, cancel) in enumerate(units):
        uid = 1000 - 37 * u  # not contiguous, not sorted, some negative
        ids += [uid] * len(unit_rows)
        if cancel:  # the unit's gradient cancels across its rows, up to a tiny residual
            extra_x.append(x[start])
            extra_y.append(-y[start] * (1 + 1e-7))
            ids.append(uid)
        start += len(unit_rows)
    if extra_x:
        x, y = torch.cat([x, torch.stack(extra_x)]), torch.cat([y, torch.stack(extra_y)])
    perm = torch.randperm(len(ids), generator=gen)
    return x[perm], y[perm], torch.tensor(ids, dtype=torch.int64)[perm]


def _state(kind, names, clip):
    if kind == "group":
        first = names[0]
        bounds = {first: clip, "": 2 * clip} if len(names) > 1 else {first: clip}
        state = GroupClipping(bounds)
        return state, {n: (first if n == first else "") for n in names}, state.sensitivity
    if kind == "auto_s":
        return AutoSClipping(clip, 0.01), None, clip
    if kind == "adaptive":
        state = AdaptiveClipping(clip, count_noise_multiplier=1.0, expected_batch_size=4, seed=0)
        return state, None, clip
    return clip, None, clip


def _diff(a, b):
    return {k: a[k].double() - b[k].double() for k in a}


def _moderate(units) -> bool:
    return all(
        {p, q} <= {"random", "zero"} and abs(ex) <= 6 and abs(ey) <= 6 and not cancel
        for rows, cancel in units
        for p, q, ex, ey, _ in rows
    )


def _check(name, units, engine, kind, clip, seed, microbatch_size):
    loss, params, shape = _case(name)
    x, y, ids = _batch(shape, units, seed)
    state, groups, bound = _state(kind, tuple(params), clip)
    grad_fn, state = clipped_grad(
        loss,
        clipping_norm=state,
        batch_argnums=(1, 2),
        engine=engine,
        clipping_groups=groups,
        microbatch_size=microbatch_size,
        check_unused=False,
    )
    total, _ = grad_fn(params, x, y, state=state, units=ids)
    assert all(bool(torch.isfinite(g).all()) for g in total.values())
    batch, worst, parts = len(ids), 0.0, []
    for uid in torch.unique(ids).tolist():
        keep = ids == uid
        alone, _ = grad_fn(params, x, y, state=state, units=ids, example_mask=keep)
        norm = testing.exact_norm(alone)
        worst = max(worst, norm / bound)
        assert norm <= bound * (1 + TOL), (uid, norm, bound)
        parts.append(alone)
        # the neighbouring batch: the unit's rows removed (any number of them)
        without, _ = grad_fn(params, x[~keep], y[~keep], state=state, units=ids[~keep])
        moved = testing.exact_norm(_diff(total, without))
        assert moved <= bound * (1 + 1e-4 * batch), (uid, moved, bound)
    target(worst, label=f"{name}/{engine}/{kind}: unit contribution / bound")
    for key, value in total.items():
        want = sum((p[key].double() for p in parts), torch.zeros(value.shape, dtype=torch.float64))
        err = float((value.double() - want).abs().max()) if value.numel() else 0.0
        assert err <= 1e-4 * max(1, batch) * bound, key
    return loss, params, x, y, ids, total


@pytest.mark.parametrize("name", sorted(RULES))
@SEARCH
@given(
    units=st.lists(UNIT, min_size=0, max_size=3),
    engine=st.sampled_from(["bookkeeping", "vmap"]),
    kind=st.sampled_from(["fixed", "group", "auto_s", "adaptive"]),
    clip=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
    microbatch_size=st.sampled_from([None, 2]),
)
@example(  # one unit of two huge rows that cancel: its gradient is the tiny residual
    units=[([("repeated", "random", 0.0, 20.0, -12.0)], True)],
    engine="bookkeeping",
    kind="fixed",
    clip=1.0,
    seed=0,
    microbatch_size=None,
)
@example(  # underflowing and huge rows in one unit, a plain unit beside it, split chunks
    units=[
        (
            [("random", "random", 0.0, -30.0, 0.0), ("alternating", "repeated", 15.0, 15.0, -9.0)],
            False,
        ),
        ([("random", "random", 0.0, 0.0, 0.0)], False),
    ],
    engine="bookkeeping",
    kind="fixed",
    clip=1.0,
    seed=1,
    microbatch_size=2,
)
def test_removing_a_unit_moves_the_sum_by_at_most_its_bound(
    name, units, engine, kind, clip, seed, microbatch_size
):
    loss, params, x, y, ids, total = _check(name, units, engine, kind, clip, seed, microbatch_size)
    if kind in ("fixed", "adaptive") and len(ids) and _moderate(units):
        one = loss.per_example(batch_argnums=(1, 2), has_aux=False)
        params64 = {k: v.double() for k, v in params.items()}
        x64 = x if x.dtype == torch.int64 else x.double()
        grads, _ = testing.per_example_grads_loop(
            one, (params64, x64, y.double()), batch_argnums=(1, 2)
        )
        per_unit = []
        for uid in torch.unique(ids).tolist():
            rows = (ids == uid).nonzero().flatten().tolist()
            per_unit.append({k: sum(grads[i][k] for i in rows) for k in params})
        want = testing.reference_clipped_sum(per_unit, clipping_norm=clip)
        testing.assert_grads_close(total, want, rtol=2e-3, atol=2e-3 * clip * len(ids))


def test_a_cancelling_unit_is_measured_as_the_sum_of_its_rows():
    """Two rows of one unit, each far above C, cancelling up to 1e-7 of their size: the unit's
    gradient is tiny and must not be clipped as if it were large (nor its bound be loose)."""
    loss, params, shape = _case("linear-ghost")
    units = [([("random", "random", 0.0, 0.0, 0.0)], True)]
    x, y, ids = _batch(shape, units, 0)
    y = y * 10.0
    grad_fn, state = clipped_grad(
        loss, clipping_norm=1.0, batch_argnums=(1, 2), engine="bookkeeping", return_aux=True
    )
    (got, aux), _ = grad_fn(params, x, y, state=state, units=ids)
    assert grad_fn.engine == "bookkeeping"  # its check per unit passed too
    # the oracle in fp64: in fp32, each row's rounding is as large as the unit's gradient
    one = loss.per_example(batch_argnums=(1, 2), has_aux=False)
    params64 = {k: v.double() for k, v in params.items()}
    grads, _ = testing.per_example_grads_loop(
        one, (params64, x.double(), y.double()), batch_argnums=(1, 2)
    )
    rows = [math.sqrt(sum(float(v.square().sum()) for v in g.values())) for g in grads]
    unit = {k: grads[0][k] + grads[1][k] for k in params}
    norm = math.sqrt(sum(float(v.square().sum()) for v in unit.values()))
    assert min(rows) > 100.0
    assert norm < 1.0  # not clipped: the factor is 1
    assert float(aux.clipping_rate) == 0.0
    # the weight's Gram norm cancels, so it takes the exact route (fp64 blocks): exact; the
    # bias rows were each reduced over their tokens in fp32, whose rounding (of the rows'
    # size) is what their sum keeps — utility, not privacy: the bound is the summed tensor's
    testing.assert_grads_close({"weight": got["weight"]}, {"weight": unit["weight"]}, rtol=1e-6)
    testing.assert_grads_close({"bias": got["bias"]}, {"bias": unit["bias"]}, atol=1e-7 * max(rows))
