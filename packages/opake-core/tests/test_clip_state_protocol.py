"""The clip-state protocol: a new clipping method is one class; the built-in ones keep the bound."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opake.core.errors import ConfigurationError
from opake.dpsgd.bookkeeping import BatchedLoss
from opake.dpsgd.clipping import (
    AdaptiveClipping,
    AutoSClipping,
    ChunkNorms,
    ClipFactors,
    ClipState,
    FixedClipping,
    GroupClipping,
    clip_state_from_dict,
    clipped_grad,
)


@dataclass(frozen=True)
class PerLeafClipping(ClipState):
    """Each of the L leaves of an example's gradient clipped to C/√L (sensitivity C)."""

    kind: ClassVar[str] = "test_per_leaf"
    clipping_norm: float

    @property
    def sensitivity(self) -> float:
        return self.clipping_norm

    def factors(self, norms: ChunkNorms) -> ClipFactors:
        leaves = norms.leaf_sq.shape[1]
        contributes = norms.contributes
        each = self.clipping_norm / math.sqrt(leaves)
        factor = (each / (norms.bound_sq.sqrt() + 1e-6)).clamp(max=1.0)
        factor = torch.where(contributes[:, None], factor, 0.0)
        after = (norms.leaf_sq.sqrt() * factor).square().sum(dim=1).sqrt()
        rounded = factor.float()
        rounded = torch.where(
            rounded.double() > factor, torch.nextafter(rounded, 0 * rounded), rounded
        )
        return ClipFactors(
            leaf_factor=rounded,
            contributes=contributes,
            clipped_norms=torch.where(contributes, after, 0.0),
            shrunk=(factor < 1.0).any(dim=1),
        )

    def to_dict(self):
        return {"kind": self.kind, "clipping_norm": self.clipping_norm}

    @classmethod
    def from_dict(cls, data):
        return cls(data["clipping_norm"])


def _linear_problem():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    params = {k: v.detach() for k, v in lin.named_parameters()}
    x = torch.randn(7, 3) * 4

    def losses(p, x):
        return torch.func.functional_call(lin, p, (x,)).square().sum(dim=1)

    return lin, params, x, losses


def _per_leaf_reference(lin, params, x, clip):
    total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in params.items()}
    for i in range(x.shape[0]):
        own = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        loss = torch.func.functional_call(lin, own, (x[i : i + 1],)).square().sum()
        grads = dict(zip(own, torch.autograd.grad(loss, list(own.values())), strict=True))
        for k, g in grads.items():
            factor = min(1.0, clip / math.sqrt(len(grads)) / (float(g.double().norm()) + 1e-6))
            total[k] += factor * g.double()
    return total


@pytest.mark.parametrize("method", ["vmap", "bookkeeping"])
def test_a_new_method_is_one_class(method):
    lin, params, x, losses = _linear_problem()
    state = PerLeafClipping(0.8)
    assert clip_state_from_dict(state.to_dict()) == state  # registered by its kind
    grad_fn, state = clipped_grad(
        BatchedLoss(losses, lin), clipping_norm=state, microbatch_size=3, engine=method
    )
    grads, new_state = grad_fn(params, x, state=state)
    assert grad_fn.engine == method
    assert new_state is state
    assert grads.max_norm == 0.8
    want = _per_leaf_reference(lin, params, x, 0.8)
    for k in params:
        torch.testing.assert_close(grads[k].double(), want[k], rtol=1e-4, atol=1e-6)


def test_a_kind_is_taken_once():
    with pytest.raises(ConfigurationError, match="taken"):

        @dataclass(frozen=True)
        class Other(ClipState):
            kind: ClassVar[str] = "fixed"


def test_a_method_missing_its_factors_cannot_be_built():
    @dataclass(frozen=True)
    class NoFactors(ClipState):
        kind: ClassVar[str] = "test-no-factors"

        @property
        def sensitivity(self) -> float:
            return 1.0

        def to_dict(self) -> dict[str, Any]:
            return {"kind": self.kind}

        @classmethod
        def from_dict(cls, data: Any) -> ClipState:
            return cls()

    with pytest.raises(TypeError, match="factors"):
        NoFactors()


_STATES = [
    FixedClipping(1.5),
    AutoSClipping(1.5, stability=0.01),
    AdaptiveClipping(1.5, count_noise_multiplier=1.0, expected_batch_size=4, seed=0),
    GroupClipping({"a": 1.0, "b": 2.0}),
]
_special = st.sampled_from([0.0, math.inf, math.nan, 1e-300, 1e300, 1.0])
_sq = st.one_of(st.floats(min_value=0.0, max_value=1e30), _special)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.tuples(_sq, _sq, _sq, st.booleans()), min_size=1, max_size=6),
    which=st.integers(min_value=0, max_value=len(_STATES) - 1),
)
def test_factors_keep_every_example_within_the_bound(rows, which):
    """Search chunks of squared norms (0, subnormal, huge, inf, NaN, padding) for a factor that
    lets an example's clipped gradient exceed the sensitivity, or padding contribute."""
    state = _STATES[which]
    leaf_sq = torch.tensor([r[:3] for r in rows], dtype=torch.float64)
    is_real = torch.tensor([r[3] for r in rows])
    groups = state.leaf_groups(("a.x", "b.y", "a.z"), None)
    factors = state.factors(ChunkNorms(leaf_sq, leaf_sq, is_real, groups))
    assert factors.leaf_factor.dtype == torch.float32
    assert bool((factors.leaf_factor >= 0).all())
    clipped = (leaf_sq * factors.leaf_factor.double().square()).sum(dim=1).sqrt()
    finite = torch.isfinite(leaf_sq.sum(dim=1))
    ok = torch.where(
        finite, clipped <= state.sensitivity * (1 + 1e-6), factors.leaf_factor.sum(1) == 0
    )
    assert bool(ok.all()), (clipped, factors.leaf_factor)
    assert bool((factors.leaf_factor[~is_real] == 0).all())
    assert bool((factors.leaf_factor[~factors.contributes] == 0).all())
