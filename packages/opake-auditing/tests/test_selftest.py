"""The self-test: correct DP-SGD stays below its claim; four broken mechanisms are caught.

Faults are injected here, by monkeypatching opake-core's implementation for one test: the
product has no option that breaks it.
"""

from __future__ import annotations

import pytest
import torch

import opake.dpsgd._noise as noise_module
import opake.dpsgd.clipping._base as clip_engine
import opake.dpsgd.sampling as sampling
from opake.auditing import self_test
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


def test_correct_dpsgd_stays_below_its_claim():
    result = self_test(seed=1)
    assert result.claimed_epsilon == pytest.approx(2.0, abs=0.01)
    assert result.consistent, result.summary()
    assert result.epsilon_lower_bound < 1.0


@pytest.mark.parametrize(
    "fault", ["noise_skipped", "clipping_bypassed", "norm_underestimated", "fixed_public_order"]
)
def test_a_broken_mechanism_is_caught(fault, request):
    request.getfixturevalue(fault)
    result = self_test(seed=0)
    assert result.claimed_epsilon == pytest.approx(2.0, abs=0.01)  # the claim is unchanged
    assert not result.consistent, result.summary()
    assert result.epsilon_lower_bound > 2.2


def test_the_fault_fixtures_really_break_the_mechanism(noise_skipped):
    from opake.dpsgd.noise import GaussianNoise

    out = GaussianNoise(1.0, seed=0).add({"w": torch.zeros(3)}, sensitivity=1.0)
    assert torch.equal(out["w"], torch.zeros(3))
