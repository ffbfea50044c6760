"""DPTraining: the composed DP step against a hand-written step and the per-example oracle."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from opake import accounting
from opake.core.errors import ConfigurationError, OperationError
from opake.core.testing import reference_clipped_grad, tiny_mlp
from opake.dpsgd.clipping import AdaptiveClipping, clipped_grad, gradient_noise_multiplier
from opake.dpsgd.noise import GaussianNoise
from opake.dpsgd.optimizer import DPOptimizer
from opake.dpsgd.sampling import PoissonSampler, padding_mask
from opake.dpsgd.training import DPTraining, PrivacyBudgetExhausted
from opake.functional import make_functional

_spec = importlib.util.spec_from_file_location(
    "_training_helpers", Path(__file__).with_name("_training_helpers.py")
)
assert _spec is not None
assert _spec.loader is not None
T = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(T)

N, B, SIGMA, C, LR, DELTA, SEED = 64, 8.0, 1.3, 0.7, 0.2, 1e-5, 11
FAST = {"accountant": "rdp"}
SETTINGS = {
    "dataset_size": N,
    "expected_batch_size": B,
    "noise_multiplier": SIGMA,
    "delta": DELTA,
    "clipping_norm": C,
    "seed": SEED,
    **FAST,
}


def _training(model=None, **options):
    return T.training({**SETTINGS, **options}, model, lr=LR)


def test_one_step_equals_a_hand_written_step_and_the_oracle():
    x, y = T.data(N)
    model, training = _training()
    indices = next(training.batches())
    assert indices == PoissonSampler(N, B / N, seed=SEED).global_batch(0).tolist()
    start = T.params(model)
    result = training.step(x[indices], y[indices])

    # hand-written: clipped_grad + DPOptimizer, same seeds
    manual = tiny_mlp(seed=0)
    fmodel, params = make_functional(manual)
    grad_fn, state = clipped_grad(T.loss(fmodel), clipping_norm=C, batch_argnums=(1, 2))
    grads, _ = grad_fn(params, x[indices], y[indices], state=state)
    opt = DPOptimizer(
        torch.optim.SGD(manual.parameters(), lr=LR),
        manual,
        noise_multiplier=SIGMA,
        expected_batch_size=B,
        seed=SEED,
    )
    opt.accumulate(grads)
    opt.step()
    for name, value in T.params(manual).items():
        torch.testing.assert_close(T.params(model)[name], value, atol=1e-6, rtol=1e-6)

    # the obvious reference: per-example autograd loop, clip, sum, one noise draw, / q·N, SGD
    total = reference_clipped_grad(
        T.loss(make_functional(tiny_mlp(seed=0))[0]),
        (start, x[indices], y[indices]),
        clipping_norm=C,
        batch_argnums=(1, 2),
    )
    noisy = GaussianNoise(SIGMA, seed=SEED).add(
        {n: v.float() for n, v in total.items()}, sensitivity=C
    )
    for name, value in start.items():
        expected = value - LR * noisy[name] / B
        torch.testing.assert_close(T.params(model)[name], expected, atol=2e-6, rtol=1e-5)
    assert result.step == 1
    assert result.batch_size == len(indices)
    assert result.report.expected_batch_size == B
    assert result.report.noise_std == pytest.approx(SIGMA * C)


def test_accumulated_physical_batches_equal_one_physical_batch():
    x, y = T.data(N)
    model_a, one = _training()
    model_b, split = _training()
    for _, (a, b) in zip(range(4), zip(one.batches(), split.batches(), strict=True), strict=False):
        assert a == b
        one.step(x[a], y[a])
        half = len(b) // 2
        result = split.logical_step([(x[b[:half]], y[b[:half]]), (x[b[half:]], y[b[half:]])])
        assert result.report.physical_batches == 2
    for name, value in T.params(model_a).items():
        torch.testing.assert_close(T.params(model_b)[name], value, atol=1e-6, rtol=1e-6)


def test_a_new_step_releases_the_last_steps_grad_before_clipping():
    x, y = T.data(N)
    model, training = _training()
    batches = training.batches()
    first = next(batches)
    training.step(x[first], y[first])
    held = [p.grad for p in model.parameters()]
    assert all(g is not None for g in held)  # visible between steps, as after optimizer.step()
    seen = []
    clip = training._grad_fn

    def watching(*args, **kwargs):
        seen.append([p.grad for p in model.parameters()])
        return clip(*args, **kwargs)

    training._grad_fn = watching
    second = next(batches)
    half = len(second) // 2
    training.logical_step(
        [(x[second[:half]], y[second[:half]]), (x[second[half:]], y[second[half:]])]
    )
    assert len(seen) == 2
    assert all(g is None for g in seen[0])  # released before the new step's first clipping
    assert all(g is None for g in seen[1])  # and nothing set between its physical batches


def test_epsilon_after_n_steps_equals_the_accountant_for_the_schedule():
    x, y = T.data(N)
    _, training = _training()
    for _, indices in zip(range(7), training.batches(), strict=False):
        training.step(x[indices], y[indices])
    expected = accounting.epsilon(
        sample_rate=B / N, noise_multiplier=SIGMA, steps=7, delta=DELTA, accountant="rdp"
    )
    assert training.epsilon() == pytest.approx(expected, rel=1e-12)


def test_empty_poisson_batch_still_takes_a_noisy_step():
    x, y = T.data(N)
    model, training = _training()
    before = T.params(model)
    result = training.step(x[:0], y[:0])
    assert result.batch_size == 0
    assert result.loss != result.loss  # nan: no example
    assert any(not torch.equal(before[n], v) for n, v in T.params(model).items())
    assert training.accountant.steps == 1


def test_budget_is_calibrated_spent_and_refused_before_touching_data():
    x, y = T.data(N)
    calls = []
    model = tiny_mlp(seed=0)
    fmodel, params = make_functional(model)
    loss = T.loss(fmodel)

    def counted(p, xi, yi):
        calls.append(1)
        return loss(p, xi, yi)

    training = DPTraining(
        counted,
        torch.optim.SGD(model.parameters(), lr=LR),
        params,
        batch_args=2,
        dataset_size=N,
        expected_batch_size=B,
        target_epsilon=3.0,
        steps=5,
        delta=DELTA,
        seed=SEED,
        **FAST,
    )
    sigma = accounting.calibrate_noise(
        target_epsilon=3.0, delta=DELTA, sample_rate=B / N, steps=5, accountant="rdp"
    )
    assert training.noise_multiplier == pytest.approx(sigma)
    assert training.steps_left == 5
    batches = training.batches()
    for _ in range(5):
        indices = next(batches)
        training.step(x[indices], y[indices])
    assert training.exhausted
    assert training.steps_left == 0
    assert training.epsilon() <= 3.0
    calls.clear()
    with pytest.raises(PrivacyBudgetExhausted, match=r"target_epsilon = 3"):
        training.step(x[:4], y[:4])
    assert not calls  # no example was looked at for the refused step
    assert training.accountant.steps == 5


def test_noise_multiplier_with_a_budget_stops_at_the_budget():
    _, training = _training(target_epsilon=2.0)
    allowed = training.steps_left
    assert allowed is not None
    assert (
        accounting.epsilon(
            sample_rate=B / N, noise_multiplier=SIGMA, steps=allowed, delta=DELTA, accountant="rdp"
        )
        <= 2.0
    )
    assert (
        accounting.epsilon(
            sample_rate=B / N,
            noise_multiplier=SIGMA,
            steps=allowed + 1,
            delta=DELTA,
            accountant="rdp",
        )
        > 2.0
    )


def test_resume_from_state_dict_and_from_a_file_is_bitwise(tmp_path):
    x, y = T.data(N)
    model_a, full = _training()
    for _, idx in zip(range(6), full.batches(), strict=False):
        full.step(x[idx], y[idx])

    model_b, first = _training()
    batches = first.batches()
    for _ in range(3):
        idx = next(batches)
        first.step(x[idx], y[idx])
    next(batches)  # a prefetching loader drew one batch ahead: not trained, not saved
    state = copy.deepcopy(first.state_dict())
    assert state["sampler"]["position"] == 3
    first.save(tmp_path / "run.pt", model=model_b, extra={"note": "half"})
    saved_params = T.params(model_b)

    for how in ("state_dict", "file"):
        model_c, second = _training(model=tiny_mlp(seed=5))
        if how == "state_dict":
            model_c.load_state_dict(saved_params)
            second.load_state_dict(state)
        else:
            assert second.load(tmp_path / "run.pt", model=model_c) == {"note": "half"}
        assert second.steps == 3
        for _, idx in zip(range(3), second.batches(), strict=False):
            second.step(x[idx], y[idx])
        for name, value in T.params(model_a).items():
            assert torch.equal(T.params(model_c)[name], value), (how, name)
        assert second.epsilon() == full.epsilon()


def test_resume_refuses_other_privacy_settings(tmp_path):
    x, y = T.data(N)
    _, first = _training()
    first.step(x[:3], y[:3])
    state = first.state_dict()
    _, other = _training(expected_batch_size=16.0)
    with pytest.raises(ConfigurationError, match="sample_rate"):
        other.load_state_dict(state)


def _resume(training, how, state, path):
    """Resume ``training`` from a state dict or from a checkpoint file."""
    if how == "state_dict":
        training.load_state_dict(state)
    else:
        training.load(path)


@pytest.mark.parametrize("how", ["state_dict", "file"])
def test_resume_refuses_other_clipping_instead_of_ignoring_it(tmp_path, how):
    # the saved state used to replace the new clipping norm without a word
    from opake.dpsgd.checkpoint import CheckpointError
    from opake.dpsgd.clipping import AutoSClipping

    x, y = T.data(N)
    _, first = _training()
    first.step(x[:3], y[:3])
    state, path = first.state_dict(), first.save(tmp_path / "run.pt")
    cases = [
        (2.0 * C, f"FixedClipping\\(clipping_norm={C}\\), this training with .*={2.0 * C}"),
        (AutoSClipping(C), "clips with FixedClipping, this training with AutoSClipping"),
    ]
    if how == "file":  # the checkpoint's own loader refuses another method first
        cases[1] = (AutoSClipping(C), "FixedClipping but the template given is a AutoSClipping")
    for clipping, match in cases:
        _, other = _training(clipping_norm=clipping)
        with pytest.raises((ConfigurationError, CheckpointError), match=match):
            _resume(other, how, state, path)
        assert other.clip_state.to_dict() != first.clip_state.to_dict()
        assert other.steps == 0  # validated before anything is restored
        assert other.epsilon() == 0.0
    _, same = _training()
    same.load(path)  # the saved settings resume
    assert same.steps == first.steps


@pytest.mark.parametrize("how", ["state_dict", "file", "plain file"])
def test_resume_refuses_another_noise_multiplier_instead_of_adopting_it(tmp_path, how):
    # the saved σ used to replace the one this training was built with, without a word (ε was
    # right — the accountant records the σ used — but the setting given was ignored)
    from opake.dpsgd.checkpoint import save_checkpoint

    x, y = T.data(N)
    _, first = _training()
    first.step(x[:3], y[:3])
    state, path = first.state_dict(), first.save(tmp_path / "run.pt")
    if how == "plain file":  # written without DPTraining's settings: σ is still compared
        path = tmp_path / "plain.pt"
        parts = {"optimizer": first.optimizer, "sampler": first.sampler}
        save_checkpoint(path, step=1, accountant=first.accountant, **parts)
    loads = "file" if how != "state_dict" else how
    _, other = _training(noise_multiplier=2.0 * SIGMA)
    with pytest.raises(ConfigurationError, match=f"noise_multiplier={SIGMA}, this .* {2 * SIGMA}"):
        _resume(other, loads, state, path)
    assert other.noise_multiplier == 2.0 * SIGMA
    assert other.steps == other.accountant.steps == 0
    # σ calibrated from a target ε for another number of steps is another σ: refused too
    _, planned = _training(noise_multiplier=None, target_epsilon=3.0, steps=40)
    planned.step(x[:3], y[:3])
    _, longer = _training(noise_multiplier=None, target_epsilon=3.0, steps=80)
    with pytest.raises(ConfigurationError, match="target_epsilon and steps"):
        longer.load_state_dict(planned.state_dict())
    _, same = _training(noise_multiplier=None, target_epsilon=3.0, steps=40)
    same.load_state_dict(planned.state_dict())
    assert same.steps == 1


@pytest.mark.parametrize("how", ["state_dict", "file"])
def test_a_refused_resume_never_winds_the_accounting_back(tmp_path, how):
    # a load refused only after restoring put a 5-step training's accountant, sampler and
    # noise counter back to the file's 3 steps, under a model that kept all 5
    x, y = T.data(N)
    _, early = _training()
    for _ in range(3):
        early.step(x[:3], y[:3])
    state, path = early.state_dict(), early.save(tmp_path / "early.pt")
    _, later = _training(clipping_norm=2.0 * C)
    for _ in range(5):
        later.step(x[:3], y[:3])
    spent, noise = later.epsilon(), copy.deepcopy(later.optimizer.state_dict())
    with pytest.raises(ConfigurationError, match="clips with"):
        _resume(later, how, state, path)
    assert later.steps == later.accountant.steps == 5
    assert later.epsilon() == spent
    assert later.optimizer.state_dict()["noise"] == noise["noise"]


@pytest.mark.parametrize(
    "edit",
    [
        "plain clip state",
        "damaged sampler",
        "damaged rng",
        "damaged numpy rng",
        "damaged cuda rng",
        "damaged position",
    ],
)
def test_a_damaged_file_never_winds_the_accounting_back(tmp_path, edit):
    from opake.dpsgd.checkpoint import CheckpointError

    x, y = T.data(N)
    early_model, early = _training()
    for _ in range(3):
        early.step(x[:3], y[:3])
    path = early.save(tmp_path / "early.pt", model=early_model)
    payload = torch.load(path, weights_only=True)
    parts = payload["components"]
    if edit == "plain clip state":  # kind "plain" used to skip the clipping check
        parts["clip_state"] = {"kind": "plain", "type": "dict", "state": {"clipping_norm": 9.0}}
    elif edit == "damaged sampler":  # the sampler cannot check a state before restoring it
        parts["sampler"]["state"] = {"kind": "?"}
    elif edit == "damaged rng":
        parts["rng"]["torch"] = torch.zeros(3, dtype=torch.uint8)
    elif edit == "damaged cuda rng":
        parts["rng"]["cuda"] = [torch.zeros(3, dtype=torch.float32)]
    elif edit == "damaged numpy rng":
        parts["rng"]["numpy"]["keys"] = torch.zeros(3, dtype=torch.int64)
    else:
        parts["sampler"]["state"]["position"] = -1
    torch.save(payload, path)
    model, later = _training()
    for _ in range(5):
        later.step(x[:3], y[:3])
    spent, noise = later.epsilon(), copy.deepcopy(later.optimizer.state_dict()["noise"])
    weights, sampler = T.params(model), later.sampler.state_dict()
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    with pytest.raises((ConfigurationError, CheckpointError)):
        later.load(path, model=model)
    assert later.steps == later.accountant.steps == 5
    assert later.epsilon() == spent
    assert later.optimizer.state_dict()["noise"] == noise
    # every part is checked before any is restored: the model, sampler and RNG are untouched
    assert all(torch.equal(T.params(model)[n], w) for n, w in weights.items())
    assert later.sampler.state_dict() == sampler
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("damaged", ["accountant", "optimizer"])
def test_a_damaged_state_dict_restores_nothing(damaged):
    x, y = T.data(N)
    _, first = _training()
    for _ in range(3):
        first.step(x[:3], y[:3])
    state = copy.deepcopy(first.state_dict())
    state[damaged] = {"not": "a state"}
    _, other = _training()
    other.step(x[:3], y[:3])
    before = (copy.deepcopy(other.optimizer.state_dict()["noise"]), other.sampler.state_dict())
    with pytest.raises((ConfigurationError, KeyError, TypeError, ValueError)):
        other.load_state_dict(state)
    assert other.steps == other.accountant.steps == 1
    assert other.optimizer.state_dict()["noise"] == before[0]
    assert other.sampler.state_dict() == before[1]


def test_adaptive_clipping_resumes_its_moved_bound_but_not_other_settings():
    x, y = T.data(N)

    def adaptive(sigma_b):
        state = AdaptiveClipping(1.0, count_noise_multiplier=sigma_b, expected_batch_size=B)
        sigma = gradient_noise_multiplier(SIGMA, count_noise_multiplier=sigma_b)
        return _training(clipping_norm=state, noise_multiplier=sigma)[1]

    first = adaptive(5.0)
    for _, idx in zip(range(2), first.batches(), strict=False):
        first.step(x[idx], y[idx])
    state = first.state_dict()
    same = adaptive(5.0)
    same.load_state_dict(state)  # the bound moved: the saved one is taken
    assert same.clip_state.clipping_norm == first.clip_state.clipping_norm != 1.0
    assert same.clip_state.step == 2
    other = adaptive(1000.0)  # used to be taken, then refused at the next step's count noise
    with pytest.raises(ConfigurationError, match="clips with"):
        other.load_state_dict(state)
    assert other.steps == 0


def test_state_is_refused_mid_step_and_accumulation_can_be_dropped():
    x, y = T.data(N)
    _, training = _training()
    training.accumulate(x[:3], y[:3])
    assert training.pending_batches == 1
    with pytest.raises(OperationError, match="un-noised"):
        training.state_dict()
    training.zero_grad()
    assert training.pending_batches == 0
    with pytest.raises(OperationError, match="nothing accumulated"):
        training.finish_step()
    assert training.accountant.steps == 0


def test_hooks_receive_every_step_and_can_be_removed():
    x, y = T.data(N)
    _, training = _training()
    seen = []
    remove = training.add_hook(seen.append)
    training.step(x[:5], y[:5])
    training.step(x[5:9], y[5:9])
    remove()
    training.step(x[:2], y[:2])
    assert [r.step for r in seen] == [1, 2]
    assert seen[0].batch_size == 5
    assert 0.0 <= seen[0].clipping_rate <= 1.0
    assert seen[0].loss == pytest.approx(seen[0].loss_sum / 5)


def test_fixed_shape_sampling_masks_padding_and_accounts_the_truncation():
    x, y = T.data(N)
    _, training = _training(sampler="fixed", max_batch_size=24)
    indices = next(training.batches())
    assert len(indices) == 24
    mask = padding_mask(indices)
    safe = torch.as_tensor(indices).clamp_min(0)
    result = training.step(x[safe], y[safe], example_mask=mask)
    assert result.batch_size == int(mask.sum())
    expected = accounting.epsilon(
        sample_rate=B / N,
        noise_multiplier=SIGMA,
        steps=1,
        delta=DELTA,
        accountant="rdp",
        max_batch_size=24,
        dataset_size=N,
    )
    assert training.epsilon() == pytest.approx(expected, rel=1e-12)


def test_adaptive_clipping_count_query_is_accounted():
    x, y = T.data(N)
    sigma_b = 5.0
    state = AdaptiveClipping(1.0, count_noise_multiplier=sigma_b, expected_batch_size=B, seed=2)
    sigma_grad = gradient_noise_multiplier(SIGMA, count_noise_multiplier=sigma_b)
    _, training = _training(clipping_norm=state, noise_multiplier=sigma_grad)
    for _, idx in zip(range(3), training.batches(), strict=False):
        training.step(x[idx], y[idx])
    assert training.clip_state.step == 3  # the bound moved once per logical step
    expected = accounting.epsilon(
        sample_rate=B / N,
        noise_multiplier=sigma_grad,
        count_noise_multiplier=sigma_b,
        steps=3,
        delta=DELTA,
        accountant="rdp",
    )
    assert training.epsilon() == pytest.approx(expected, rel=1e-12)


def test_secure_by_default_and_bad_options_raise():
    _, secure = _training(seed=None)
    _, other = _training(seed=None)
    assert secure.secure
    assert secure.sampler.seed is None  # the key is never stored
    draws = [
        [i for _, b in zip(range(20), t.batches(), strict=False) for i in b]
        for t in (secure, other)
    ]
    assert draws[0] != draws[1]
    with pytest.raises(ConfigurationError, match="unknown keyword"):
        _training(clip=1.0)
    with pytest.raises(ConfigurationError, match="exactly one"):
        _training(sample_rate=0.1)
    with pytest.raises(ConfigurationError, match="steps="):
        _training(noise_multiplier=None, target_epsilon=1.0)
    with pytest.raises(ConfigurationError, match="engine"):
        _training(engine="fast")
    with pytest.raises(ConfigurationError, match="batch_args"):
        _training()[1].step(torch.zeros(1, 8))


def test_set_params_rebinds_the_gradient_function_to_new_storage():
    x, y = T.data(N)
    model, training = _training()
    # a wrapper gave the parameters new storage: the old functional view is stale
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    fresh = {n: p.detach() for n, p in model.named_parameters()}
    training.set_params(fresh)
    aux = training.accumulate(x[:4], y[:4])
    training.zero_grad()
    grad_fn, state = clipped_grad(
        T.loss(make_functional(model)[0]), clipping_norm=C, batch_argnums=(1, 2), return_aux=True
    )
    (_, want), _ = grad_fn(fresh, x[:4], y[:4], state=state)
    torch.testing.assert_close(aux.loss_values, want.loss_values)
    with pytest.raises(ConfigurationError, match="same parameter names"):
        training.set_params({"w": torch.zeros(1)})


def test_load_takes_a_plain_checkpoint_of_the_same_parts_and_refuses_one_without_accountant(
    tmp_path,
):
    from opake.dpsgd.checkpoint import CheckpointError, save_checkpoint

    x, y = T.data(N)
    _, first = _training()
    first.step(x[:4], y[:4])
    parts = {"optimizer": first.optimizer, "sampler": first.sampler, "clip_state": first.clip_state}
    save_checkpoint(tmp_path / "plain.pt", step=1, accountant=first.accountant, **parts)
    save_checkpoint(tmp_path / "no_accountant.pt", step=1, **parts)
    _, second = _training()
    second.load(tmp_path / "plain.pt")
    assert second.steps == 1
    assert second.epsilon() == first.epsilon()
    _, third = _training()
    with pytest.raises(CheckpointError, match="accountant"):
        third.load(tmp_path / "no_accountant.pt")
    assert third.accountant.steps == 0


def test_fixed_shape_sampling_reaches_a_target_epsilon_above_ln_999():
    # With a truncation budget of δ/1000 alone, the (1 + e^ε)·T·p charge exceeds δ for any
    # ε > ln(999) ≈ 6.9: a target of 8 was silently capped. The budget now scales with the target.
    model = tiny_mlp(seed=0)
    fmodel, params = make_functional(model)
    n, steps = 2000, 50
    training = DPTraining(
        T.loss(fmodel),
        torch.optim.SGD(model.parameters(), lr=LR),
        params,
        batch_args=2,
        dataset_size=n,
        expected_batch_size=20,
        target_epsilon=8.0,
        steps=steps,
        delta=DELTA,
        sampler="fixed",
        seed=SEED,
        **FAST,
    )
    planned = accounting.epsilon(
        sample_rate=training.sample_rate,
        noise_multiplier=training.noise_multiplier,
        steps=steps,
        delta=DELTA,
        accountant="rdp",
        max_batch_size=training.sampler.max_batch_size,
        dataset_size=n,
    )
    assert 0.98 * 8.0 <= planned <= 8.0


def test_the_budget_search_never_returns_an_unchecked_number_of_steps():
    # ε stays under the target for 2⁴⁰ steps and jumps past it right after: the search stops
    # at 2⁴⁰ (checked) rather than at the next power of two (never checked; a review found it)
    from opake.dpsgd.training._budget import _steps_within

    def after(k: int) -> float:
        return 0.0 if k <= 2**40 else 1e9

    found = _steps_within(after, guess=0, target=1.0)
    assert after(found) <= 1.0
    assert found == 2**40
