"""AUTO-S, per-group and adaptive clipping, and the clip states' serialisation."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from opake.accounting import effective_noise_multiplier
from opake.core import testing
from opake.core.errors import ConfigurationError, InputTypeError
from opake.dpsgd.clipping import (
    AdaptiveClipping,
    AutoSClipping,
    FixedClipping,
    GroupClipping,
    adaptive_noise_split,
    clip_state_from_dict,
    clipped_grad,
    gradient_noise_multiplier,
)
from opake.functional import make_functional


@pytest.fixture
def mlp_problem(mlp, mlp_batch):
    fmodel, params = make_functional(mlp)

    def loss_fn(params, x, y):
        return torch.nn.functional.cross_entropy(fmodel(params, x[None]), y[None])

    x, y = mlp_batch
    return loss_fn, params, x, y


def _vector_loss(params, v):
    """Per-example gradient of w is exactly v: lets a test choose every gradient."""
    return (params["w"] * v).sum()


# ---------------------------------------------------------------- AUTO-S
def test_auto_s_matches_loop(mlp_problem):
    loss_fn, params, x, y = mlp_problem
    method = AutoSClipping(clipping_norm=0.7, stability=0.05)
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=method, batch_argnums=(1, 2), microbatch_size=4, return_aux=True
    )
    (grads, aux), new_state = grad_fn(params, x, y, state=state)
    assert new_state is state
    expected = testing.reference_clipped_grad(
        loss_fn, (params, x, y), clipping_norm=method, batch_argnums=(1, 2)
    )
    testing.assert_grads_close(grads, expected)
    assert grads.max_norm == 0.7
    torch.testing.assert_close(
        aux.clipped_grad_norms, 0.7 * aux.grad_norms / (aux.grad_norms + 0.05)
    )
    assert bool((aux.clipped_grad_norms < 0.7).all())


def test_auto_s_scales_small_gradients_up():
    grad_fn, state = clipped_grad(
        _vector_loss, clipping_norm=AutoSClipping(1.0, 0.01), return_aux=True
    )
    v = torch.tensor([[0.1, 0.0], [0.0, 100.0]])
    (grads, aux), _ = grad_fn({"w": torch.zeros(2)}, v, state=state)
    torch.testing.assert_close(grads["w"], torch.tensor([0.1 / 0.11, 100.0 / 100.01]))
    assert float(aux.clipping_rate) == 0.5  # only the large one is scaled down


# ---------------------------------------------------------------- per-group
def test_group_clipping_by_prefix_matches_loop(mlp_problem):
    loss_fn, params, x, y = mlp_problem
    bounds = {"0": 0.3, "2": 0.2}
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=bounds, batch_argnums=(1, 2), microbatch_size=3, return_aux=True
    )
    assert state == GroupClipping(bounds)
    (grads, aux), _ = grad_fn(params, x, y, state=state)
    groups = {name: name.split(".")[0] for name in params}
    expected = testing.reference_clipped_grad(
        loss_fn, (params, x, y), clipping_norm=bounds, groups=groups, batch_argnums=(1, 2)
    )
    testing.assert_grads_close(grads, expected)
    assert grads.max_norm == pytest.approx(math.sqrt(0.3**2 + 0.2**2))
    assert set(aux.group_grad_norms) == {"0", "2"}
    total = (aux.group_grad_norms["0"].square() + aux.group_grad_norms["2"].square()).sqrt()
    torch.testing.assert_close(total, aux.grad_norms)
    assert bool((aux.clipped_grad_norms <= grads.max_norm * (1 + 1e-6)).all())


@pytest.mark.parametrize(
    "spec",
    [
        lambda name: "weights" if name.endswith("weight") else "biases",
        {"0.weight": "weights", "2.weight": "weights", "0.bias": "biases", "2.bias": "biases"},
    ],
)
def test_group_clipping_callable_and_mapping(mlp_problem, spec):
    loss_fn, params, x, y = mlp_problem
    bounds = {"weights": 0.4, "biases": 0.05}
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=bounds, clipping_groups=spec, batch_argnums=(1, 2)
    )
    grads, _ = grad_fn(params, x, y, state=state)
    groups = {n: "weights" if n.endswith("weight") else "biases" for n in params}
    expected = testing.reference_clipped_grad(
        loss_fn, (params, x, y), clipping_norm=bounds, groups=groups, batch_argnums=(1, 2)
    )
    testing.assert_grads_close(grads, expected)


def test_group_catch_all_and_longest_prefix(mlp_problem):
    loss_fn, params, x, y = mlp_problem
    bounds = {"": 0.5, "2": 0.1, "2.bias": 0.01}
    grad_fn, state = clipped_grad(loss_fn, clipping_norm=bounds, batch_argnums=(1, 2))
    grads, _ = grad_fn(params, x, y, state=state)
    groups = {"0.weight": "", "0.bias": "", "2.weight": "2", "2.bias": "2.bias"}
    expected = testing.reference_clipped_grad(
        loss_fn, (params, x, y), clipping_norm=bounds, groups=groups, batch_argnums=(1, 2)
    )
    testing.assert_grads_close(grads, expected)


@pytest.mark.parametrize(
    ("bounds", "spec", "match"),
    [
        ({"0": 1.0}, None, r"belong to no group"),
        ({"0": 1.0, "2": 1.0, "3": 1.0}, None, r"match no differentiated parameter"),
        ({"weights": 1.0}, lambda name: "weight", r"has no bound.*did you mean 'weights'"),
    ],
)
def test_group_assignment_errors(mlp_problem, bounds, spec, match):
    loss_fn, params, x, y = mlp_problem
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=bounds, clipping_groups=spec, batch_argnums=(1, 2)
    )
    with pytest.raises(ConfigurationError, match=match):
        grad_fn(params, x, y, state=state)


# ---------------------------------------------------------------- adaptive
def _adaptive(clip: float, **kwargs) -> AdaptiveClipping:
    options = {"count_noise_multiplier": 1e-9, "expected_batch_size": 4, "seed": 0}
    options.update(kwargs)
    return AdaptiveClipping(clip, **options)


def test_adaptive_clips_like_fixed_at_current_norm(mlp_problem):
    loss_fn, params, x, y = mlp_problem
    grad_fn, state = clipped_grad(loss_fn, clipping_norm=_adaptive(0.8), batch_argnums=(1, 2))
    grads, new_state = grad_fn(params, x, y, state=state)
    expected = testing.reference_clipped_grad(
        loss_fn, (params, x, y), clipping_norm=0.8, batch_argnums=(1, 2)
    )
    testing.assert_grads_close(grads, expected)
    assert grads.max_norm == 0.8  # the C this step used, not the updated one
    assert new_state.step == 1
    assert new_state.clipping_norm != 0.8


@pytest.mark.parametrize(("clip", "fraction"), [(1e3, 1.0), (1e-3, 0.0)])
def test_adaptive_geometric_update(clip, fraction):
    v = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [0.0, 4.0]])
    state = _adaptive(clip, target_quantile=0.3, learning_rate=0.25)
    grad_fn, state = clipped_grad(_vector_loss, clipping_norm=state)
    _, new_state = grad_fn({"w": torch.zeros(2)}, v, state=state)
    assert new_state.clipping_norm == pytest.approx(clip * math.exp(-0.25 * (fraction - 0.3)))


def test_adaptive_accumulates_until_end_step():
    v = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [0.0, 4.0]])
    grad_fn, state = clipped_grad(
        _vector_loss, clipping_norm=_adaptive(2.5, count_noise_multiplier=0.7)
    )
    w = {"w": torch.zeros(2)}
    whole, whole_state = grad_fn(w, v, state=state)
    first, mid = grad_fn(w, v[:3], state=state, end_step=False)
    assert mid.clipping_norm == 2.5
    assert mid.step == 0
    assert float(mid.pending_count) == 0.5  # norms 1, 2 ≤ 2.5 < 3: (1+1+0) - 3/2
    second, last = grad_fn(w, v[3:], state=mid)
    assert last == whole_state
    testing.assert_grads_close(first + second, whole, rtol=1e-6)


def test_adaptive_count_ignores_padding_and_counts_nonfinite_as_clipped():
    v = torch.tensor([[1.0, 0.0], [float("nan"), 0.0], [0.5, 0.0], [9.0, 0.0]])
    grad_fn, state = clipped_grad(_vector_loss, clipping_norm=_adaptive(2.0))
    mask = torch.tensor([True, True, True, False])
    _, mid = grad_fn({"w": torch.zeros(2)}, v, state=state, example_mask=mask, end_step=False)
    assert float(mid.pending_count) == 0.5  # 1 and 0.5 below, NaN clipped, 9 is padding


def test_adaptive_converges_to_target_quantile():
    norms = torch.linspace(1.0, 10.0, 64)
    v = torch.stack([norms, torch.zeros(64)], dim=1)
    state = AdaptiveClipping(
        1.0,
        target_quantile=0.25,
        learning_rate=0.2,
        count_noise_multiplier=64 / 20,
        expected_batch_size=64,
        seed=3,
    )
    grad_fn, state = clipped_grad(_vector_loss, clipping_norm=state)
    w = {"w": torch.zeros(2)}
    for _ in range(150):
        _, state = grad_fn(w, v, state=state)
    assert 2.5 < state.clipping_norm < 4.0  # the 25 % quantile of 1..10 is 3.25


def test_adaptive_count_noise_has_std_sigma_b():
    """log(C'/C) = −η((Σ(b−½) + N(0, σ_b²))/n + ½ − γ): recover the noise from C'."""
    sigma_b, n, lr = 3.0, 10.0, 0.5
    state = AdaptiveClipping(
        1.0, learning_rate=lr, count_noise_multiplier=sigma_b, expected_batch_size=n, seed=11
    )
    noises = []
    for _ in range(4000):
        new = state.end_step()  # pending count 0, target 0.5 → the exponent is pure noise
        noises.append(-math.log(new.clipping_norm / state.clipping_norm) / lr * n)
        state = new
    # 4000 draws: the sample std has relative standard error 1/sqrt(2·4000) ≈ 1.1 %; 5 % is
    # more than four standard errors (the seed is fixed, so the test is deterministic anyway)
    assert statistics.fmean(noises) == pytest.approx(0.0, abs=4 * sigma_b / math.sqrt(4000))
    assert statistics.stdev(noises) == pytest.approx(sigma_b, rel=0.05)


def test_adaptive_seeded_reproducible_and_secure_varies():
    a = _adaptive(1.0, count_noise_multiplier=2.0, seed=5).end_step()
    b = _adaptive(1.0, count_noise_multiplier=2.0, seed=5).end_step()
    c = _adaptive(1.0, count_noise_multiplier=2.0, seed=6).end_step()
    assert a == b
    assert a.clipping_norm != c.clipping_norm
    secure = [_adaptive(1.0, count_noise_multiplier=2.0, seed=None).end_step() for _ in range(3)]
    assert len({s.clipping_norm for s in secure}) == 3


def test_adaptive_state_round_trip_mid_step_resumes_identically():
    v = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [0.0, 4.0]])
    grad_fn, state = clipped_grad(
        _vector_loss, clipping_norm=_adaptive(2.5, count_noise_multiplier=0.7, seed=9)
    )
    w = {"w": torch.zeros(2)}
    _, mid = grad_fn(w, v[:2], state=state, end_step=False)
    _, straight = grad_fn(w, v[2:], state=mid)
    restored = clip_state_from_dict(json.loads(json.dumps(mid.to_dict())))
    assert restored == mid
    _, resumed = grad_fn(w, v[2:], state=restored)
    assert resumed == straight


def test_adaptive_end_step_reduce_is_applied():
    state = _adaptive(1.0, expected_batch_size=10).add_count(torch.tensor(1.0))
    doubled = state.end_step(reduce=lambda count: 2 * count)
    assert doubled.clipping_norm == pytest.approx(math.exp(-0.2 * (2.0 / 10)))


def test_noise_split_matches_accounting():
    split = adaptive_noise_split(1.2, count_noise_multiplier=5.0)
    assert split.gradient_noise_multiplier == pytest.approx(
        gradient_noise_multiplier(1.2, count_noise_multiplier=5.0)
    )
    # the two queries together are exactly a Gaussian mechanism with the total σ
    assert effective_noise_multiplier(
        split.gradient_noise_multiplier, count_noise_multiplier=5.0
    ) == pytest.approx(1.2)
    assert split.count_privacy_fraction == pytest.approx(1.2**2 / 10.0**2)
    assert _adaptive(1.0, count_noise_multiplier=5.0).noise_split(1.2) == split
    with pytest.raises(ConfigurationError, match="2σ_b > σ"):
        adaptive_noise_split(1.2, count_noise_multiplier=0.5)


# ---------------------------------------------------------------- states
@pytest.mark.parametrize(
    "state",
    [
        FixedClipping(1.5),
        GroupClipping({"a": 1.0, "b": 2.0}),
        AutoSClipping(2.0, 0.1),
        AdaptiveClipping(
            0.7,
            0.4,
            0.3,
            count_noise_multiplier=1.5,
            expected_batch_size=32,
            seed=1,
            step=12,
            pending_count=-2.5,
        ),
    ],
)
def test_states_round_trip_through_json(state):
    data = json.loads(json.dumps(state.to_dict()))
    again = clip_state_from_dict(data)
    assert again == state
    assert type(again) is type(state)
    assert type(state).from_dict(data) == state
    assert hash(again) == hash(state)
    with pytest.raises(AttributeError):
        state.clipping_norm = 3.0  # frozen


def test_state_sensitivities():
    assert FixedClipping(2.0).sensitivity == 2.0
    assert GroupClipping({"a": 3.0, "b": 4.0}).sensitivity == 5.0
    assert AutoSClipping(0.5).sensitivity == 0.5
    assert _adaptive(0.25).sensitivity == 0.25


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda: FixedClipping(0.0), ConfigurationError, "positive finite"),
        (lambda: GroupClipping({1: 1.0}), InputTypeError, "expected str"),
        (lambda: AutoSClipping(1.0, stability=0.0), ConfigurationError, "stability"),
        (lambda: _adaptive(1.0, target_quantile=1.0), ConfigurationError, r"in \(0, 1\)"),
        (lambda: _adaptive(1.0, learning_rate=-0.1), ConfigurationError, "learning_rate"),
        (lambda: _adaptive(1.0, count_noise_multiplier=0.0), ConfigurationError, "count_noise"),
        (lambda: _adaptive(1.0, expected_batch_size=0), ConfigurationError, "expected_batch"),
        (lambda: _adaptive(1.0, seed=True), InputTypeError, "seed"),
        (lambda: _adaptive(1.0, step=-1), ConfigurationError, "step"),
        (lambda: clip_state_from_dict({"kind": "magic"}), ConfigurationError, "magic"),
        (lambda: FixedClipping.from_dict({"kind": "fixed"}), ConfigurationError, "missing"),
        (
            lambda: FixedClipping.from_dict({"clipping_norm": 1.0, "extra": 1}),
            ConfigurationError,
            "unknown keys",
        ),
    ],
)
def test_bad_states_raise(build, error, match):
    with pytest.raises(error, match=match):
        build()
