"""The self-test: correct DP-SGD stays below its claim, on the book-keeping engine a full-model
run uses and on the vmap engine; five broken mechanisms are caught.

Faults are injected here, by monkeypatching opake-core's implementation for one test: the
product has no option that breaks it. The faults run at seed 1: over seeds 0–5 every fault
exceeds the claim (ε = 2), the weakest — a fixed public batch order — at 2.05–2.71 (2.05 at
seed 0, just above it), the others at 2.86 and more.
"""

from __future__ import annotations

import pytest
import torch

import opake.dpsgd.clipping._base as clip_engine
import opake.dpsgd.noise._gaussian as noise_module
import opake.dpsgd.sampling as sampling
from opake.auditing import CRAFTED_KINDS, self_test
from opake.dpsgd.bookkeeping._certify import LeafBounds
from opake.dpsgd.bookkeeping._fused import LeafBoundsFn
from opake.dpsgd.sampling import PoissonSampler


@pytest.fixture
def noise_skipped(monkeypatch):
    """DPOptimizer still reports σ·C as its noise std, but no noise is drawn."""

    def add(self, grads, sensitivity=None, **kwargs):
        return dict(grads)

    monkeypatch.setattr(noise_module.GaussianNoise, "add", add)
    monkeypatch.setattr(noise_module.GaussianNoise, "add_", add)  # DPOptimizer's in-place path


@pytest.fixture
def clipping_bypassed(monkeypatch):
    """Every contributing example keeps its whole gradient (factor 1)."""
    monkeypatch.setattr(
        clip_engine, "_fp32_toward_zero", lambda f: torch.where(f > 0, 1.0, 0.0).float()
    )


@pytest.fixture
def norm_underestimated(monkeypatch):
    """Clipping factors computed from norms 10× too small: min(1, C / (‖g‖/10))."""
    original = clip_engine._fp32_toward_zero
    monkeypatch.setattr(
        clip_engine, "_fp32_toward_zero", lambda f: original((f * 10.0).clamp(max=1.0))
    )


class FixedOrderSampler(PoissonSampler):
    """Batches of ⌊qN⌉ consecutive indices in a public order, accounted as Poisson."""

    def _batch(self, step):
        size = round(self.sample_rate * self.dataset_size)
        return [(step * size + j) % self.dataset_size for j in range(size)]


@pytest.fixture
def fixed_public_order(monkeypatch):
    monkeypatch.setattr(sampling, "PoissonSampler", FixedOrderSampler)


@pytest.fixture
def gram_norm_trusted(monkeypatch):
    """Book-keeping as before its certified bounds: each example clipped by its computed
    (Gram) norm, no error terms, never measured exactly — what cancellation, underflow and
    absorption fooled."""
    original = LeafBoundsFn.__call__  # what the runner asks for every leaf's bounds

    def leaf_bounds(self, *args, **kwargs):
        leaf = original(self, *args, **kwargs)
        zero = torch.zeros_like(leaf.sq)
        return LeafBounds(leaf.sq, leaf.sq.sqrt(), zero, zero > 0, leaf.rounding)

    monkeypatch.setattr(LeafBoundsFn, "__call__", leaf_bounds)


@pytest.mark.parametrize("engine", ["auto", "vmap"])
def test_correct_dpsgd_stays_below_its_claim(engine):
    result = self_test(seed=1, engine=engine)
    assert result.claimed_epsilon == pytest.approx(2.0, abs=0.01)
    assert result.consistent, result.summary()
    assert result.epsilon_lower_bound < 1.0
    # "auto" on a full model is book-keeping, for the data and for every canary
    used = "bookkeeping" if engine == "auto" else "vmap"
    assert result.engine == used
    assert result.extra["engine_steps"] == {"data": {used: 100}, "canaries": {used: 100}}


@pytest.mark.parametrize(
    "fault",
    [
        "noise_skipped",
        "clipping_bypassed",
        "norm_underestimated",
        "fixed_public_order",
    ],
)
def test_a_broken_mechanism_is_caught(fault, request):
    request.getfixturevalue(fault)
    result = self_test(seed=1)
    assert result.claimed_epsilon == pytest.approx(2.0, abs=0.01)  # the claim is unchanged
    assert not result.consistent, result.summary()
    assert result.epsilon_lower_bound > 2.2
    assert result.engine == "bookkeeping"


def test_only_the_crafted_canaries_catch_a_trusted_gram_norm(gram_norm_trusted):
    """Book-keeping trusting its computed Gram norm is caught — by the crafted canaries alone:
    the plain ones' computed norms are right, so without the crafted ones no violation is
    found."""
    plain = self_test(seed=1, crafted=False)
    assert plain.consistent, plain.summary()  # no violation found without crafted canaries
    crafted = self_test(seed=1)
    assert not crafted.consistent, crafted.summary()
    assert crafted.group in CRAFTED_KINDS  # found kind by kind
    assert crafted.correct == crafted.guesses


def test_the_fault_fixtures_really_break_the_mechanism(noise_skipped):
    from opake.dpsgd.noise import GaussianNoise

    out = GaussianNoise(1.0, seed=0).add({"w": torch.zeros(3)}, sensitivity=1.0)
    assert torch.equal(out["w"], torch.zeros(3))
