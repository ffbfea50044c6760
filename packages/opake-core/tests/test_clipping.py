"""clipped_grad against the per-example loop oracle, and its contract (shapes, aux, errors)."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from opake.core import testing
from opake.core.errors import ConfigurationError, InputTypeError, OpakePrivacyWarning
from opake.dpsgd.clipping import ClipAux, ClippedGrads, FixedClipping, clipped_grad
from opake.functional import make_functional


def _mlp_loss(fmodel):
    def loss_fn(params, x, y):
        return torch.nn.functional.cross_entropy(fmodel(params, x[None]), y[None])

    return loss_fn


def _median_norm(loss_fn, args, **kwargs) -> float:
    grads, _ = testing.per_example_grads_loop(loss_fn, args, **kwargs)
    norms = sorted(math.sqrt(sum(float(g.square().sum()) for g in d.values())) for d in grads)
    middle = len(norms) // 2
    return 0.5 * (norms[middle - 1] + norms[middle])  # between two examples' norms


@pytest.fixture
def mlp_problem(mlp, mlp_batch):
    fmodel, params = make_functional(mlp)
    loss_fn = _mlp_loss(fmodel)
    x, y = mlp_batch
    clip = _median_norm(loss_fn, (params, x, y), batch_argnums=(1, 2))
    return loss_fn, params, x, y, clip


def test_mlp_matches_loop_and_some_examples_are_clipped(mlp_problem):
    loss_fn, params, x, y, clip = mlp_problem
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=clip, batch_argnums=(1, 2), return_aux=True
    )
    (grads, aux), new_state = grad_fn(params, x, y, state=state)
    expected = testing.reference_clipped_grad(
        loss_fn, (params, x, y), clipping_norm=clip, batch_argnums=(1, 2)
    )
    testing.assert_grads_close(grads, expected, rtol=1e-5)
    assert isinstance(grads, ClippedGrads)
    assert all(v.dtype == torch.float32 for v in grads.values())
    assert grads.max_norm == clip
    assert int(grads.batch_size) == 10
    assert new_state == state == FixedClipping(clip)
    # about half the examples are above the median norm
    assert 0.3 <= float(aux.clipping_rate) <= 0.6
    assert int(aux.nonfinite_count) == 0


def test_aux_matches_loop(mlp_problem):
    loss_fn, params, x, y, clip = mlp_problem
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=clip, batch_argnums=(1, 2), return_aux=True
    )
    (_, aux), _ = grad_fn(params, x, y, state=state)
    assert isinstance(aux, ClipAux)
    ref_grads, ref_losses = testing.per_example_grads_loop(
        loss_fn, (params, x, y), batch_argnums=(1, 2)
    )
    ref_norms = torch.tensor(
        [math.sqrt(sum(float(g.double().square().sum()) for g in d.values())) for d in ref_grads],
        dtype=torch.float64,
    )
    torch.testing.assert_close(aux.loss_values, torch.stack(ref_losses))
    torch.testing.assert_close(aux.grad_norms.double(), ref_norms, rtol=1e-5, atol=0)
    torch.testing.assert_close(
        aux.clipped_grad_norms.double(), ref_norms.clamp(max=clip), rtol=1e-5, atol=0
    )
    assert float(aux.clipping_rate) == pytest.approx(float((ref_norms > clip).double().mean()))
    assert int(aux.batch_size) == 10
    assert aux.loss_aux is None
    assert aux.group_grad_norms is None


@pytest.mark.parametrize("microbatch_size", [1, 3, 8, 10, None])
def test_microbatch_invariance(mlp_problem, microbatch_size):
    loss_fn, params, x, y, clip = mlp_problem
    whole_fn, state = clipped_grad(loss_fn, clipping_norm=clip, batch_argnums=(1, 2))
    whole, _ = whole_fn(params, x, y, state=state)
    chunked_fn, _ = clipped_grad(
        loss_fn,
        clipping_norm=clip,
        batch_argnums=(1, 2),
        microbatch_size=microbatch_size,
        return_aux=True,
    )
    (chunked, aux), _ = chunked_fn(params, x, y, state=state)
    testing.assert_grads_close(chunked, whole, rtol=1e-6)
    assert aux.loss_values.shape == (10,)
    assert aux.grad_norms.shape == (10,)


def test_batch_argnums_int_with_pytree_batch(mlp_problem):
    loss_fn, params, x, y, clip = mlp_problem

    def dict_loss(batch, params):  # batch first, params second: argnums=1, batch_argnums=0
        return loss_fn(params, batch["x"], batch["y"])

    grad_fn, state = clipped_grad(
        dict_loss, argnums=1, clipping_norm=clip, batch_argnums=0, microbatch_size=4
    )
    grads, _ = grad_fn({"x": x, "y": y}, params, state=state)
    expected = testing.reference_clipped_grad(
        loss_fn, (params, x, y), clipping_norm=clip, batch_argnums=(1, 2)
    )
    testing.assert_grads_close(grads, expected)


def test_non_batched_extra_argument(mlp_problem):
    loss_fn, params, x, y, clip = mlp_problem

    def scaled_loss(params, scale, x, y):
        return scale * loss_fn(params, x, y)

    grad_fn, state = clipped_grad(scaled_loss, clipping_norm=clip, batch_argnums=(2, 3))
    grads, _ = grad_fn(params, torch.tensor(0.5), x, y, state=state)
    expected = testing.reference_clipped_grad(
        scaled_loss, (params, torch.tensor(0.5), x, y), clipping_norm=clip, batch_argnums=(2, 3)
    )
    testing.assert_grads_close(grads, expected)


def test_has_aux_stacks_aux_over_microbatches(mlp_problem):
    loss_fn, params, x, y, clip = mlp_problem

    def aux_loss(params, x, y):
        loss = loss_fn(params, x, y)
        return loss, {"double": 2 * loss, "x_sum": x.sum()}

    grad_fn, state = clipped_grad(
        aux_loss,
        has_aux=True,
        clipping_norm=clip,
        batch_argnums=(1, 2),
        microbatch_size=3,
        return_aux=True,
    )
    (grads, aux), _ = grad_fn(params, x, y, state=state)
    torch.testing.assert_close(aux.loss_aux["double"], 2 * aux.loss_values)
    torch.testing.assert_close(aux.loss_aux["x_sum"], x.sum(dim=1))
    expected = testing.reference_clipped_grad(
        aux_loss, (params, x, y), clipping_norm=clip, batch_argnums=(1, 2), has_aux=True
    )
    testing.assert_grads_close(grads, expected)
    # has_aux without return_aux: the aux is computed and dropped
    plain_fn, _ = clipped_grad(aux_loss, has_aux=True, clipping_norm=clip, batch_argnums=(1, 2))
    plain, _ = plain_fn(params, x, y, state=state)
    testing.assert_grads_close(plain, grads, rtol=1e-6)


def test_empty_batch_gives_zero_grads(mlp_problem):
    loss_fn, params, x, y, clip = mlp_problem
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=clip, batch_argnums=(1, 2), return_aux=True, normalize_by=4.0
    )
    (grads, aux), new_state = grad_fn(params, x[:0], y[:0], state=state)
    assert set(grads) == set(params)
    for name, value in grads.items():
        assert value.shape == params[name].shape
        assert value.dtype == torch.float32
        assert not value.any()
    assert int(grads.batch_size) == 0
    assert grads.max_norm == clip / 4.0
    assert float(aux.clipping_rate) == 0.0
    assert aux.loss_values.shape == (0,)
    assert new_state == state


def test_example_mask_drops_padding(mlp_problem):
    loss_fn, params, x, y, clip = mlp_problem
    mask = torch.tensor([True, False, True, True, False, True, True, True, False, True])
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=clip, batch_argnums=(1, 2), microbatch_size=4, return_aux=True
    )
    (grads, aux), _ = grad_fn(params, x, y, state=state, example_mask=mask)
    expected = testing.reference_clipped_grad(
        loss_fn, (params, x, y), clipping_norm=clip, batch_argnums=(1, 2), example_mask=mask
    )
    testing.assert_grads_close(grads, expected)
    assert int(grads.batch_size) == 7
    assert not aux.clipped_grad_norms[~mask].any()
    with pytest.raises(InputTypeError, match="bool tensor of shape"):
        grad_fn(params, x, y, state=state, example_mask=torch.ones(10))


def test_nonfinite_example_contributes_zero_and_is_counted(mlp_problem):
    loss_fn, params, x, y, clip = mlp_problem
    x = x.clone()
    x[3, 0] = float("nan")
    x[7, 1] = float("inf")
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=clip, batch_argnums=(1, 2), microbatch_size=4, return_aux=True
    )
    (grads, aux), _ = grad_fn(params, x, y, state=state)
    assert all(bool(torch.isfinite(v).all()) for v in grads.values())
    keep = [i not in (3, 7) for i in range(10)]
    expected = testing.reference_clipped_grad(
        loss_fn, (params, x, y), clipping_norm=clip, batch_argnums=(1, 2), example_mask=keep
    )
    testing.assert_grads_close(grads, expected)
    assert int(aux.nonfinite_count) == 2
    assert int(aux.batch_size) == 10
    assert float(aux.clipped_grad_norms[3]) == 0.0
    assert not math.isfinite(float(aux.grad_norms[3]))


def test_normalize_by_divides_sum_and_sensitivity(mlp_problem):
    loss_fn, params, x, y, clip = mlp_problem
    grad_fn, state = clipped_grad(loss_fn, clipping_norm=clip, batch_argnums=(1, 2))
    raw, _ = grad_fn(params, x, y, state=state)
    norm_fn, _ = clipped_grad(loss_fn, clipping_norm=clip, batch_argnums=(1, 2), normalize_by=8)
    scaled, _ = norm_fn(params, x, y, state=state)
    testing.assert_grads_close(scaled, {k: v / 8 for k, v in raw.items()}, rtol=1e-6)
    assert scaled.max_norm == pytest.approx(clip / 8)


def test_runs_without_graph_even_for_params_requiring_grad(mlp_problem):
    loss_fn, params, x, y, clip = mlp_problem
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    grad_fn, state = clipped_grad(loss_fn, clipping_norm=clip, batch_argnums=(1, 2))
    grads, _ = grad_fn(leaves, x, y, state=state)
    assert all(v.grad_fn is None and not v.requires_grad for v in grads.values())


def test_outer_transform_differentiates_through_grad_fn():
    # loss_i(w) = ½ a_i ‖w‖² → per-example grad a_i w (norm ≪ C: unclipped); the sum is
    # (Σ a_i) w, and d/dw Σ_j (sum)_j = Σ a_i for every coordinate.
    a = torch.tensor([0.5, 1.0, 2.0])

    def loss_fn(params, a_i):
        return 0.5 * a_i * params["w"].square().sum()

    grad_fn, state = clipped_grad(loss_fn, clipping_norm=1e6)

    def outer(w):
        grads, _ = grad_fn({"w": w}, a, state=state)
        return grads["w"].sum()

    w = torch.tensor([0.1, -0.2])
    torch.testing.assert_close(torch.func.grad(outer)(w), torch.full((2,), 3.5))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_compute_dtype_keeps_fp32_sums(mlp_problem, dtype):
    loss_fn, params, x, y, clip = mlp_problem
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=clip, batch_argnums=(1, 2), compute_dtype=dtype, return_aux=True
    )
    (grads, aux), _ = grad_fn(params, x, y, state=state)
    assert all(v.dtype == torch.float32 for v in grads.values())
    assert aux.loss_values.dtype == torch.float32
    expected = testing.reference_clipped_grad(
        loss_fn, (params, x, y), clipping_norm=clip, batch_argnums=(1, 2)
    )
    testing.assert_grads_close(grads, expected, rtol=1e-6 if dtype == torch.float64 else 5e-2)


def test_unused_parameter_warns_once(mlp_problem):
    loss_fn, params, x, y, clip = mlp_problem

    def loss_ignoring_extra(params, x, y):
        return loss_fn({k: v for k, v in params.items() if k != "unused"}, x, y)

    extra = {**params, "unused": torch.zeros(3)}
    grad_fn, state = clipped_grad(loss_ignoring_extra, clipping_norm=clip, batch_argnums=(1, 2))
    with pytest.warns(OpakePrivacyWarning, match=r"\['unused'\]"):
        grads, _ = grad_fn(extra, x, y, state=state)
    assert not grads["unused"].any()
    grad_fn(extra, x, y, state=state)  # second call: no warning (warnings are errors here)
    quiet_fn, _ = clipped_grad(
        loss_ignoring_extra, clipping_norm=clip, batch_argnums=(1, 2), check_unused=False
    )
    quiet_fn(extra, x, y, state=state)


def test_clipped_grads_add_and_pickle():
    a = ClippedGrads({"w": torch.ones(2)}, max_norm=1.0, batch_size=3)
    b = ClippedGrads({"w": torch.ones(2)}, max_norm=2.0, batch_size=torch.tensor(1))
    total = a + b
    assert isinstance(total, ClippedGrads)
    assert total.max_norm == 2.0
    assert int(total.batch_size) == 4
    clone = pickle.loads(pickle.dumps(total))
    assert isinstance(clone, ClippedGrads)
    assert clone.max_norm == 2.0
    assert torch.equal(clone["w"], total["w"])
    assert "max_norm=2.0" in repr(total)
    with pytest.raises(ConfigurationError, match="key sets differ"):
        a + ClippedGrads({"v": torch.ones(2)}, max_norm=1.0, batch_size=1)


def _loss(params, x):
    return (params["w"] * x).sum()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"clipping_norm": 1.0, "microbatch": 4},
            ConfigurationError,
            "did you mean 'microbatch_size'",
        ),
        ({"clipping_norm": 1.0, "noise_multiplier": 1.0}, ConfigurationError, "unknown keyword"),
        ({"clipping_norm": -1.0}, ConfigurationError, "positive finite"),
        ({"clipping_norm": 0.0}, ConfigurationError, "positive finite"),
        ({"clipping_norm": math.inf}, ConfigurationError, "positive finite"),
        ({"clipping_norm": math.nan}, ConfigurationError, "positive finite"),
        ({"clipping_norm": "1.0"}, InputTypeError, "expected a positive float C"),
        ({"clipping_norm": True}, InputTypeError, "expected a positive float C"),
        ({"clipping_norm": {}}, ConfigurationError, "non-empty mapping"),
        ({"clipping_norm": {"w": -2.0}}, ConfigurationError, "positive finite"),
        ({"clipping_norm": 1.0, "batch_argnums": ()}, ConfigurationError, "non-empty tuple"),
        ({"clipping_norm": 1.0, "batch_argnums": (0,)}, ConfigurationError, "cannot be batched"),
        ({"clipping_norm": 1.0, "batch_argnums": -1}, ConfigurationError, "non-negative int"),
        ({"clipping_norm": 1.0, "microbatch_size": 0}, ConfigurationError, "positive int"),
        (
            {"clipping_norm": 1.0, "normalize_by": 0},
            ConfigurationError,
            r"between 2\*\*-64 and 2\*\*64",
        ),
        ({"clipping_norm": 1.0, "randomness": "other"}, ConfigurationError, "randomness"),
        ({"clipping_norm": 1.0, "compute_dtype": torch.int32}, ConfigurationError, "floating"),
        ({"clipping_norm": 1.0, "clipping_groups": {"w": "a"}}, ConfigurationError, "group"),
        ({"clipping_norm": 1.0, "return_aux": 1}, InputTypeError, "True or False"),
    ],
)
def test_bad_configuration_raises(kwargs, error, match):
    with pytest.raises(error, match=match):
        clipped_grad(_loss, **kwargs)


def test_method_is_the_deprecated_name_of_engine():
    """``method=`` (the engine's former name) works for one release, warns, and gives the same
    clipped sum; both names at once are refused; the listed options name ``engine`` only."""
    x, w = torch.randn(5, 2), {"w": torch.ones(2)}
    new_fn, state = clipped_grad(_loss, clipping_norm=0.5, engine="vmap")
    with pytest.warns(DeprecationWarning, match=r"clipped_grad\(engine=\.\.\.\)") as caught:
        old_fn, _ = clipped_grad(_loss, clipping_norm=0.5, method="vmap")
    assert caught[0].filename == __file__  # points at the caller
    assert old_fn.requested_engine == new_fn.requested_engine == "vmap"
    assert torch.equal(old_fn(w, x, state=state)[0]["w"], new_fn(w, x, state=state)[0]["w"])
    with pytest.raises(ConfigurationError, match="pass engine= only"):
        clipped_grad(_loss, clipping_norm=0.5, engine="auto", method="vmap")
    deprecated = pytest.warns(DeprecationWarning, match="deprecated")
    with deprecated, pytest.raises(ConfigurationError, match="engine='x'"):
        clipped_grad(_loss, clipping_norm=0.5, method="x")
    with pytest.raises(ConfigurationError, match=r"accepted: .*engine") as err:
        clipped_grad(_loss, clipping_norm=0.5, engines="vmap")
    assert "method" not in str(err.value)


def test_missing_clipping_norm_raises():
    with pytest.raises(TypeError, match="clipping_norm"):
        clipped_grad(_loss)


def test_bad_call_arguments_raise():
    grad_fn, state = clipped_grad(_loss, clipping_norm=1.0)
    w = {"w": torch.zeros(2)}
    with pytest.raises(InputTypeError, match="expected a floating-point tensor"):
        grad_fn({"w": "zeros"}, torch.ones(3, 2), state=state)
    with pytest.raises(InputTypeError, match="floating-point"):
        grad_fn({"w": torch.zeros(2, dtype=torch.int64)}, torch.ones(3, 2), state=state)
    with pytest.raises(ConfigurationError, match="at least 2"):
        grad_fn(w, state=state)
    with pytest.raises(ConfigurationError, match="built for FixedClipping"):
        grad_fn(w, torch.ones(3, 2), state=0.5)
    two_fn, state2 = clipped_grad(
        lambda p, x, y: _loss(p, x) * y, clipping_norm=1.0, batch_argnums=(1, 2)
    )
    with pytest.raises(ConfigurationError, match="disagree on the batch size"):
        two_fn(w, torch.ones(3, 2), torch.ones(4), state=state2)
    vec_fn, state3 = clipped_grad(lambda p, x: p["w"] * x, clipping_norm=1.0)
    with pytest.raises(ConfigurationError, match="expected a scalar loss"):
        vec_fn(w, torch.ones(3, 2), state=state3)
    aux_fn, state4 = clipped_grad(_loss, has_aux=True, clipping_norm=1.0)
    with pytest.raises(ConfigurationError, match="pair"):
        aux_fn(w, torch.ones(3, 2), state=state4)


@pytest.mark.parametrize("fraction", [0.0, 1e9])
def test_expanded_forward_and_vjp_paths_agree(mlp_problem, monkeypatch, fraction):
    """Both ways of computing per-example gradients match the loop (the size rule picks one)."""
    import opake.dpsgd.clipping._vmap_engine as engine

    loss_fn, params, x, y, clip = mlp_problem

    def scaled_loss(params, scale, x, y):
        return scale * loss_fn(params, x, y), {"x_sum": x.sum()}

    monkeypatch.setattr(engine, "_EXPAND_FRACTION", fraction)
    grad_fn, state = clipped_grad(
        scaled_loss,
        has_aux=True,
        clipping_norm=clip,
        batch_argnums=(2, 3),
        microbatch_size=4,
        return_aux=True,
    )
    args = (params, torch.tensor(0.5), x, y)
    assert grad_fn._prefer_expanded(args, differentiable=False) is (fraction > 0)
    (grads, aux), _ = grad_fn(*args, state=state)
    assert grad_fn._expand_disabled is None
    expected = testing.reference_clipped_grad(
        scaled_loss, args, clipping_norm=clip, batch_argnums=(2, 3), has_aux=True
    )
    testing.assert_grads_close(grads, expected)
    _, ref_losses = testing.per_example_grads_loop(
        scaled_loss, args, batch_argnums=(2, 3), has_aux=True
    )
    torch.testing.assert_close(aux.loss_values, torch.stack(ref_losses))
    torch.testing.assert_close(aux.loss_aux["x_sum"], x.sum(dim=1))
    assert not aux.loss_aux["x_sum"].requires_grad


def test_expanded_forward_falls_back_to_vjp_for_good(monkeypatch):
    import opake.dpsgd.clipping._vmap_engine as engine

    monkeypatch.setattr(engine, "_EXPAND_FRACTION", 1e9)
    calls = {"batched": 0}

    def picky_loss(params, scale, v):  # refuses batched parameters, like an op without a rule
        if torch._C._functorch.is_batchedtensor(params["w"]):
            calls["batched"] += 1
            raise RuntimeError("no batching rule for a batched weight")
        return scale * (params["w"] * v).sum()

    grad_fn, state = clipped_grad(picky_loss, clipping_norm=10.0, batch_argnums=2)
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    grads, _ = grad_fn({"w": torch.zeros(2)}, torch.tensor(2.0), v, state=state)
    torch.testing.assert_close(grads["w"], torch.tensor([8.0, 12.0]))
    assert "no batching rule" in grad_fn._expand_disabled
    grad_fn({"w": torch.zeros(2)}, torch.tensor(2.0), v, state=state)
    assert calls["batched"] == 1  # not retried
