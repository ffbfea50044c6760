"""Property tests: the clipping bound holds for any gradient, including huge, tiny, inf and NaN."""

from __future__ import annotations

import math

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from opake.core import testing
from opake.dpsgd.clipping import AutoSClipping, clipped_grad

# fp32 rounding of the norm and of the scaling lets a clipped norm land a few ulps above C
ROUNDING = 1e-6

SPECIAL = [0.0, -0.0, 1e-45, 1e-40, 1e-30, 1e18, -1e30, 3.0e38, math.inf, -math.inf, math.nan]
ANY_FLOAT = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from(SPECIAL),
)
MODERATE = st.floats(min_value=-(2.0**50), max_value=2.0**50, width=32, allow_subnormal=True)
CLIP = st.floats(min_value=1e-6, max_value=1e6)


def _matrix(elements):
    return st.integers(1, 5).flatmap(
        lambda rows: st.integers(1, 6).flatmap(
            lambda cols: st.lists(
                st.lists(elements, min_size=cols, max_size=cols), min_size=rows, max_size=rows
            )
        )
    )


def _loss(params, v):
    # per-example gradient: w ← v[:k], b ← v[k:] exactly, split over two leaves
    k = params["w"].shape[0]
    return (params["w"] * v[:k]).sum() + (params["b"] * v[k:]).sum()


def _params(cols):
    k = (cols + 1) // 2
    return {"w": torch.zeros(k), "b": torch.zeros(cols - k)}


def _norm64(grads):
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))


@settings(max_examples=60, deadline=None)
@given(rows=_matrix(ANY_FLOAT), clip=CLIP, auto=st.booleans())
@example(rows=[[3e38]], clip=0.0625, auto=False)  # subnormal fp32 factor (found by hypothesis)
@example(rows=[[1e-45, -3e38, 2.0]], clip=1e-6, auto=True)
def test_no_clipped_example_exceeds_the_bound(rows, clip, auto):
    v = torch.tensor(rows, dtype=torch.float32)
    method = AutoSClipping(clip, 0.01) if auto else clip
    grad_fn, state = clipped_grad(_loss, clipping_norm=method, return_aux=True)
    params = _params(v.shape[1])
    bound = clip * (1 + ROUNDING)
    for i in range(v.shape[0]):
        (single, aux), _ = grad_fn(params, v[i : i + 1], state=state)
        assert all(bool(torch.isfinite(g).all()) for g in single.values())
        assert _norm64(single) <= bound
        assert float(aux.clipped_grad_norms[0]) <= bound
    (total, aux), _ = grad_fn(params, v, state=state)
    assert all(bool(torch.isfinite(g).all()) for g in total.values())
    assert _norm64(total) <= v.shape[0] * bound
    assert bool((aux.clipped_grad_norms <= bound).all())
    nonfinite = int((~torch.isfinite(v)).any(dim=1).sum())
    assert int(aux.nonfinite_count) >= nonfinite


@settings(max_examples=40, deadline=None)
@given(rows=_matrix(st.one_of(MODERATE, st.sampled_from([math.nan, math.inf]))), clip=CLIP)
def test_sum_matches_loop_and_nonfinite_examples_contribute_zero(rows, clip):
    v = torch.tensor(rows, dtype=torch.float32)
    params = _params(v.shape[1])
    grad_fn, state = clipped_grad(_loss, clipping_norm=clip, microbatch_size=2, return_aux=True)
    (grads, aux), _ = grad_fn(params, v, state=state)
    finite = torch.isfinite(v).all(dim=1)
    expected = testing.reference_clipped_grad(_loss, (params, v), clipping_norm=clip)
    # clipped summands of both signs can cancel: rounding scales with Σ‖clipped‖ ≤ B·C
    testing.assert_grads_close(grads, expected, rtol=1e-5, atol=1e-6 * v.shape[0] * clip)
    assert int(aux.nonfinite_count) == int((~finite).sum())
    assert not bool(aux.clipped_grad_norms[~finite].any())
