"""Tests for opake.dpsgd.optimizer against a slow, obvious per-example reference loop."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from opake.core.errors import (
    ConfigurationError,
    InputTypeError,
    OpakePrivacyWarning,
    OperationError,
)
from opake.dpsgd.noise import GaussianNoise
from opake.dpsgd.optimizer import DPOptimizer, StepReport

C = 0.5
SIGMA = 0.8
SEED = 1234


class ClippedSum(dict):
    """What clipped_grad's grad_fn returns: a dict of summed clipped gradients with max_norm."""

    def __init__(self, values: dict[str, torch.Tensor], max_norm: float) -> None:
        super().__init__(values)
        self.max_norm = max_norm


def make_mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def make_data(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def clipped_sum_loop(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float = C
) -> ClippedSum:
    """Per-example loop with plain autograd: gradient, clip to ``clip``, sum in fp32."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = [n for n, _ in named]
    params = [p for _, p in named]
    total = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in named}
    for i in range(x.shape[0]):
        loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        grads = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum((g.float() ** 2).sum() for g in grads))
        factor = min(1.0, clip / float(norm)) if float(norm) > 0 else 1.0
        for n, g in zip(names, grads, strict=True):
            total[n] += g.float() * factor
    return ClippedSum(total, max_norm=clip)


def reference_sgd_step(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    lr: float,
    expected: float,
    noise: GaussianNoise,
) -> None:
    """The obvious DP-SGD step: loop-clip-sum, noise with the same generator, / E, SGD."""
    total = clipped_sum_loop(model, x, y)
    noisy = noise.add(total, sensitivity=C)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.sub_(lr * (noisy[name] / expected))


def dp_for(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, **kwargs: object
) -> DPOptimizer:
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs.setdefault("noise_multiplier", SIGMA)
    kwargs.setdefault("expected_batch_size", 8.0)
    if "noise" not in kwargs:
        kwargs.setdefault("seed", SEED)
    return DPOptimizer(optimizer, model, **kwargs)  # type: ignore[arg-type]


def assert_params_close(a: torch.nn.Module, b: torch.nn.Module, *, rtol: float = 1e-5) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=rtol, atol=1e-6, msg=name)


def assert_params_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name


# -- equality with the reference loop ----------------------------------------------------------


def test_sgd_steps_match_per_example_reference_loop() -> None:
    model, ref = make_mlp(), make_mlp()
    ref_noise = GaussianNoise(SIGMA, seed=SEED)
    opt = dp_for(model, torch.optim.SGD(model.parameters(), lr=0.1), expected_batch_size=8.0)
    # realised batch sizes differ from the expected 8: the divisor must stay 8
    for step, n in enumerate((5, 11, 8)):
        x, y = make_data(n, seed=step)
        opt.accumulate(clipped_sum_loop(model, x, y))
        report = opt.step()
        reference_sgd_step(ref, x, y, lr=0.1, expected=8.0, noise=ref_noise)
        assert report.expected_batch_size == 8.0
        assert report.step == step + 1
        assert report.noise_std == pytest.approx(SIGMA * C)
        assert report.sensitivity == C
        assert report.physical_batches == 1
    assert_params_close(model, ref)
    # sanity: the update moved the parameters
    assert not torch.equal(model[0].weight, make_mlp()[0].weight)


@pytest.mark.parametrize(
    "factory",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
        lambda ps: torch.optim.Adam(ps, lr=1e-2),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
    ],
    ids=["sgd-nesterov", "adam", "adamw", "rmsprop"],
)
def test_any_torch_optimizer_gets_the_reference_noisy_mean(factory) -> None:  # type: ignore[no-untyped-def]
    model, ref = make_mlp(), make_mlp()
    opt = dp_for(model, factory(model.parameters()), expected_batch_size=6.0)
    ref_opt = factory(ref.parameters())
    ref_noise = GaussianNoise(SIGMA, seed=SEED)
    for step in range(3):
        x, y = make_data(7, seed=10 + step)
        opt.accumulate(clipped_sum_loop(model, x, y))
        opt.step()
        noisy = ref_noise.add(clipped_sum_loop(ref, x, y), sensitivity=C)
        for name, p in ref.named_parameters():
            p.grad = noisy[name] / 6.0
        ref_opt.step()
    assert_params_close(model, ref)


def test_accumulating_physical_batches_equals_one_logical_batch() -> None:
    big, split = make_mlp(), make_mlp()
    opt_big = dp_for(big, torch.optim.Adam(big.parameters(), lr=1e-2), expected_batch_size=12.0)
    opt_split = dp_for(
        split, torch.optim.Adam(split.parameters(), lr=1e-2), expected_batch_size=12.0
    )
    for step in range(2):
        x, y = make_data(12, seed=20 + step)
        opt_big.accumulate(clipped_sum_loop(big, x, y))
        report_big = opt_big.step()
        for chunk in ((0, 5), (5, 6), (6, 12)):  # uneven chunks, one of size 1
            opt_split.accumulate(clipped_sum_loop(split, x[slice(*chunk)], y[slice(*chunk)]))
        assert opt_split.pending_batches == 3
        report_split = opt_split.step()
        assert report_split.physical_batches == 3
        assert report_big.noise_std == report_split.noise_std
    assert_params_close(big, split)


def test_noise_is_drawn_once_per_logical_step() -> None:
    model = make_mlp()
    noise = GaussianNoise(SIGMA, seed=SEED)
    opt = dp_for(model, noise=noise)
    x, y = make_data(9)
    for chunk in range(3):
        opt.accumulate(clipped_sum_loop(model, x[3 * chunk : 3 * chunk + 3], y[3 * chunk :][:3]))
    assert noise.calls == 0
    opt.step()
    assert noise.calls == 1


def test_sums_are_kept_in_fp32_and_grads_cast_to_param_dtype() -> None:
    w = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    seen: list[torch.Tensor] = []

    class Recorder(GaussianNoise):
        def add(self, grads, sensitivity=None):  # type: ignore[no-untyped-def,override]
            seen.append(grads["w"].clone())
            return super().add(grads, sensitivity)

    opt = DPOptimizer(
        torch.optim.SGD([w], lr=1.0),
        {"w": w},
        expected_batch_size=1.0,
        noise=Recorder(1e-3, seed=0),
    )
    # 256 + 1 + 1 is not representable in bf16 (it rounds back to 256); fp32 keeps it exactly
    for value in (256.0, 1.0, 1.0):
        opt.accumulate(ClippedSum({"w": torch.full((4,), value, dtype=torch.bfloat16)}, 1.0))
    opt.step()
    assert seen[0].dtype == torch.float32
    assert torch.equal(seen[0], torch.full((4,), 258.0))
    assert w.grad is not None
    assert w.grad.dtype == torch.bfloat16


def test_params_dict_of_detached_aliases_names_the_module_parameters() -> None:
    # make_functional returns {name: p.detach()}: same storage, different tensor objects
    model, ref = make_mlp(), make_mlp()
    aliases = {n: p.detach() for n, p in model.named_parameters()}
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), aliases, noise_multiplier=SIGMA,
        expected_batch_size=8.0, seed=SEED,
    )  # fmt: skip
    assert opt.param_names == tuple(aliases)
    x, y = make_data(5)
    opt.accumulate(clipped_sum_loop(model, x, y))
    opt.step()
    reference_sgd_step(ref, x, y, lr=0.1, expected=8.0, noise=GaussianNoise(SIGMA, seed=SEED))
    assert_params_close(model, ref)
    assert torch.equal(aliases["0.weight"], model[0].weight)  # the alias sees the update
    with pytest.raises(ConfigurationError, match="not one of the tensors"):
        DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            {n: p.detach().clone() for n, p in model.named_parameters()},
            noise_multiplier=SIGMA, expected_batch_size=8.0, seed=SEED,
        )  # fmt: skip


def test_accumulate_never_modifies_the_callers_tensors() -> None:
    model = make_mlp()
    opt = dp_for(model)
    x, y = make_data(4)
    grads = clipped_sum_loop(model, x, y)
    before = {k: v.clone() for k, v in grads.items()}
    opt.accumulate(grads)
    opt.accumulate(grads)  # the same physical result twice: the running sum doubles
    assert all(torch.equal(grads[k], before[k]) for k in grads)
    assert torch.equal(opt._sums["0.weight"], 2 * before["0.weight"])


def test_fp64_parameters_keep_fp64_sums_and_noise() -> None:
    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = DPOptimizer(
        torch.optim.SGD([w], lr=1.0), {"w": w}, noise_multiplier=1e-3,
        expected_batch_size=1.0, seed=0,
    )  # fmt: skip
    tiny = torch.full((3,), 1e-12, dtype=torch.float64)
    opt.accumulate(ClippedSum({"w": torch.ones(3, dtype=torch.float64)}, 1.0))
    opt.accumulate(ClippedSum({"w": tiny}, 1.0))  # lost in fp32 (1 + 1e-12 == 1), kept in fp64
    assert opt._sums["w"].dtype == torch.float64
    assert bool((opt._sums["w"] > 1.0).all())
    opt.step()
    assert w.grad is not None
    assert w.grad.dtype == torch.float64


# -- accountant and report ------------------------------------------------------------------------


class RecordingAccountant:
    def __init__(self) -> None:
        self.calls: list[dict[str, float]] = []

    def step(
        self, *, noise_multiplier: float, sample_rate: float, num_steps: int, **extra: float
    ) -> None:
        self.calls.append(
            {
                "noise_multiplier": noise_multiplier,
                "sample_rate": sample_rate,
                "steps": num_steps,
                **extra,
            }
        )

    def get_epsilon(self, delta: float) -> float:
        return 0.1 * len(self.calls) + delta


def test_accountant_records_one_step_per_logical_step_with_current_sigma() -> None:
    model = make_mlp()
    acct = RecordingAccountant()
    opt = dp_for(model, accountant=acct, sample_rate=0.25, delta=1e-5)
    x, y = make_data(6)
    for _ in range(2):
        opt.accumulate(clipped_sum_loop(model, x[:3], y[:3]))
        opt.accumulate(clipped_sum_loop(model, x[3:], y[3:]))
        report = opt.step()
    opt.noise_multiplier = 1.5  # a schedule: the next step is accounted with the new σ
    opt.accumulate(clipped_sum_loop(model, x, y))
    report = opt.step()
    assert acct.calls == [
        {"noise_multiplier": SIGMA, "sample_rate": 0.25, "steps": 1},
        {"noise_multiplier": SIGMA, "sample_rate": 0.25, "steps": 1},
        {"noise_multiplier": 1.5, "sample_rate": 0.25, "steps": 1},
    ]
    assert report.epsilon == pytest.approx(0.3 + 1e-5)
    assert report.delta == 1e-5
    assert report.noise_std == pytest.approx(1.5 * C)
    assert report.noise_multiplier == 1.5


def test_real_accountant_epsilon_matches_the_plain_function() -> None:
    from opake import accounting

    model = make_mlp()
    acct = accounting.RDPAccountant()
    opt = dp_for(model, accountant=acct, sample_rate=0.05, delta=1e-5)
    x, y = make_data(4)
    for _ in range(3):
        opt.accumulate(clipped_sum_loop(model, x, y))
        report = opt.step()
    assert acct.steps == 3
    expected = accounting.epsilon(
        sample_rate=0.05, noise_multiplier=SIGMA, steps=3, delta=1e-5, accountant="rdp"
    )
    assert report.epsilon == pytest.approx(expected, rel=1e-9)


def test_accounting_options_are_recorded_with_every_step() -> None:
    model = make_mlp()
    acct = RecordingAccountant()
    opt = dp_for(
        model, accountant=acct, sample_rate=0.1, count_noise_multiplier=4.0,
        max_batch_size=16, dataset_size=80,
    )  # fmt: skip
    x, y = make_data(4)
    opt.accumulate(clipped_sum_loop(model, x, y))
    opt.step()
    assert acct.calls == [
        {
            "noise_multiplier": SIGMA, "sample_rate": 0.1, "steps": 1,
            "count_noise_multiplier": 4.0, "max_batch_size": 16, "dataset_size": 80,
        }
    ]  # fmt: skip
    with pytest.raises(ConfigurationError, match="pass both or neither"):
        dp_for(make_mlp(), accountant=acct, sample_rate=0.1, max_batch_size=16)
    with pytest.raises(ConfigurationError, match="without an accountant"):
        dp_for(make_mlp(), count_noise_multiplier=4.0)


def test_sampler_supplies_divisor_and_accounting() -> None:
    from opake.dpsgd.sampling import FixedShapePoissonSampler, PoissonSampler, ShuffleSampler

    model = make_mlp()
    x, y = make_data(4)
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=SIGMA, seed=SEED,
        sampler=PoissonSampler(80, 0.1, seed=0),
    )  # fmt: skip
    assert opt.expected_batch_size == pytest.approx(8.0)
    assert opt.sample_rate == 0.1
    acct = RecordingAccountant()
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=SIGMA, seed=SEED,
        sampler=FixedShapePoissonSampler(80, 0.1, 16, seed=0), accountant=acct,
    )  # fmt: skip
    opt.accumulate(clipped_sum_loop(model, x, y))
    opt.step()
    assert acct.calls == [
        {"noise_multiplier": SIGMA, "sample_rate": 0.1, "steps": 1, "max_batch_size": 16,
         "dataset_size": 80}
    ]  # fmt: skip
    with pytest.raises(ConfigurationError, match="but the sampler has expected_batch_size"):
        DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=SIGMA,
            expected_batch_size=10.0, sampler=PoissonSampler(80, 0.1, seed=0),
        )  # fmt: skip
    with pytest.warns(OpakePrivacyWarning, match="not Poisson"):
        shuffle = ShuffleSampler(80, 8, seed=0)
    with pytest.raises(ConfigurationError, match="not Poisson sampling"):
        DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=SIGMA,
            sampler=shuffle,
        )  # fmt: skip
    with pytest.raises(ConfigurationError, match="no expected_batch_size"):
        DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=SIGMA)


def test_report_is_a_frozen_dataclass_without_epsilon_by_default() -> None:
    model = make_mlp()
    opt = dp_for(model)
    x, y = make_data(4)
    opt.accumulate(clipped_sum_loop(model, x, y))
    report = opt.step()
    assert isinstance(report, StepReport)
    assert report.epsilon is None
    assert report.sample_rate is None
    with pytest.raises(AttributeError):
        report.step = 3  # type: ignore[misc]


def test_logical_step_runs_grad_fn_per_physical_batch() -> None:
    model, ref = make_mlp(), make_mlp()
    opt = dp_for(model, expected_batch_size=10.0)
    ref_opt = dp_for(ref, expected_batch_size=10.0)
    calls = []

    def grad_fn(params, x, y, *, state):  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        aux = {"batch_size": x.shape[0]}
        return (clipped_sum_loop(model, x, y), aux), state + 1

    x, y = make_data(10)
    batches = [(x[:4], y[:4]), (x[4:], y[4:])]
    report, state = opt.logical_step(grad_fn, dict(model.named_parameters()), batches, state=0)
    assert state == 2
    assert calls == [4, 6]
    assert report.aux == ({"batch_size": 4}, {"batch_size": 6})
    assert report.physical_batches == 2
    ref_opt.accumulate(clipped_sum_loop(ref, x, y))
    ref_opt.step()
    assert_params_close(model, ref)


def test_logical_step_releases_the_last_steps_grad_before_clipping() -> None:
    model = make_mlp()
    opt = dp_for(model, expected_batch_size=4.0)
    x, y = make_data(4)
    opt.accumulate(clipped_sum_loop(model, x, y))
    opt.step()
    assert all(p.grad is not None for p in model.parameters())  # visible after the step
    held = []

    def grad_fn(params, x, y, *, state):  # type: ignore[no-untyped-def]
        held.append([p.grad for p in model.parameters()])
        return clipped_sum_loop(model, x, y), state

    opt.logical_step(grad_fn, {}, [(x[:2], y[:2]), (x[2:], y[2:])], state=None)
    assert len(held) == 2
    assert all(g is None for grads in held for g in grads)


def test_logical_step_tells_clipped_grad_when_the_logical_step_ends() -> None:
    model = make_mlp()
    opt = dp_for(model)
    seen: list[tuple[bool, object]] = []

    def grad_fn(params, x, y, *, state, end_step=True, example_mask=None):  # type: ignore[no-untyped-def]
        seen.append((end_step, example_mask))
        return clipped_sum_loop(model, x, y), state

    x, y = make_data(6)
    mask = torch.ones(2, dtype=torch.bool)
    batches = [(x[:2], y[:2]), {"args": (x[2:4], y[2:4]), "example_mask": mask}, (x[4:], y[4:])]
    opt.logical_step(grad_fn, {}, batches, state=None)
    assert [end for end, _ in seen] == [False, False, True]
    assert seen[1][1] is mask


def test_logical_step_drops_the_partial_sum_on_error() -> None:
    model = make_mlp()
    noise = GaussianNoise(SIGMA, seed=SEED)
    opt = dp_for(model, noise=noise)
    x, y = make_data(4)

    def grad_fn(params, x, y, *, state):  # type: ignore[no-untyped-def]
        if state == 1:
            raise RuntimeError("out of memory")
        return clipped_sum_loop(model, x, y), state + 1

    with pytest.raises(RuntimeError, match="out of memory"):
        opt.logical_step(grad_fn, {}, [(x[:2], y[:2]), (x[2:], y[2:])], state=0)
    assert opt.pending_batches == 0
    assert noise.calls == 0
    with pytest.raises(ConfigurationError, match="no physical batches"):
        opt.logical_step(grad_fn, {}, [], state=0)
    with pytest.raises(InputTypeError, match="example_mask"):
        opt.logical_step(grad_fn, {}, [[x, y]], state=0)
    with pytest.raises(ConfigurationError, match="may not set"):
        opt.logical_step(grad_fn, {}, [{"args": (x, y), "end_step": True}], state=0)


def test_adaptive_clip_state_must_be_accounted() -> None:
    class AdaptiveLike:
        count_noise_multiplier = 5.0

    model = make_mlp()
    x, y = make_data(4)

    def grad_fn(params, x, y, *, state):  # type: ignore[no-untyped-def]
        return clipped_sum_loop(model, x, y), state

    opt = dp_for(model, accountant=RecordingAccountant(), sample_rate=0.1)
    with pytest.raises(ConfigurationError, match="noisy count costs privacy"):
        opt.logical_step(grad_fn, {}, [(x, y)], state=AdaptiveLike())
    acct = RecordingAccountant()
    opt = dp_for(model, accountant=acct, sample_rate=0.1, count_noise_multiplier=5.0)
    opt.logical_step(grad_fn, {}, [(x, y)], state=AdaptiveLike())
    assert acct.calls[0]["count_noise_multiplier"] == 5.0


# -- parameters without gradient ----------------------------------------------------------------


def test_parameter_missing_from_grads_is_warned_and_not_trained_on_noise() -> None:
    model = make_mlp()
    opt = dp_for(model)
    x, y = make_data(4)
    grads = clipped_sum_loop(model, x, y)
    del grads["2.bias"]
    before = model[2].bias.detach().clone()
    opt.accumulate(grads)
    with pytest.warns(OpakePrivacyWarning, match=r"2\.bias received no gradient entry"):
        report = opt.step()
    assert report.skipped_params == ("2.bias",)
    assert torch.equal(model[2].bias, before)
    assert model[2].bias.grad is None
    # the warning is for the first step only
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.accumulate(grads)
        opt.step()


def test_parameter_with_all_zero_gradient_is_named_on_the_first_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 3), "unused": torch.nn.Linear(4, 3)})
    x, y = make_data(5)

    def loss_model(inp: torch.Tensor) -> torch.Tensor:
        return model["used"](inp)

    names = [n for n, _ in model.named_parameters()]
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(5):
        loss = F.cross_entropy(loss_model(x[i : i + 1]), y[i : i + 1])
        grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
        for n, g in zip(names, grads, strict=True):
            if g is not None:
                total[n] += g
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
        expected_batch_size=5.0, seed=0,
    )  # fmt: skip
    opt.accumulate(ClippedSum(total, 100.0))
    match = r"unused\.weight, unused\.bias received an all-zero"
    with pytest.warns(OpakePrivacyWarning, match=match):
        opt.step()


def test_empty_first_batch_does_not_trigger_the_unused_check() -> None:
    x, y = make_data(4)
    for mode in ("warn", "error"):
        model = make_mlp()
        opt = dp_for(model, unused_params=mode)
        zeros = ClippedSum({n: torch.zeros_like(p) for n, p in model.named_parameters()}, C)
        grads = clipped_sum_loop(model, x, y)
        grads["2.bias"] = torch.zeros_like(grads["2.bias"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.accumulate(zeros)  # an empty Poisson batch: all sums zero, nothing to conclude
            opt.step()
        opt.accumulate(grads)
        if mode == "error":
            with pytest.raises(OperationError, match=r"2\.bias received an all-zero"):
                opt.step()
            continue
        with pytest.warns(OpakePrivacyWarning, match=r"2\.bias received an all-zero"):
            opt.step()
        # once conclusive the check is done, also after a state round trip
        fresh = dp_for(make_mlp())
        fresh.load_state_dict(opt.state_dict())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for o in (opt, fresh):
                o.accumulate(grads)
                o.step()


def test_unused_params_error_mode_refuses_before_any_update() -> None:
    model = make_mlp()
    noise = GaussianNoise(SIGMA, seed=SEED)
    opt = dp_for(model, noise=noise, unused_params="error")
    x, y = make_data(4)
    grads = clipped_sum_loop(model, x, y)
    grads["0.bias"] = torch.zeros_like(grads["0.bias"])
    before = copy.deepcopy(model)
    opt.accumulate(grads)
    with pytest.raises(OperationError, match=r"0\.bias"):
        opt.step()
    assert noise.calls == 0
    assert opt.pending_batches == 0
    assert_params_equal(model, before)


# -- offload ---------------------------------------------------------------------------------


@pytest.mark.parametrize("momentum_opt", ["adam", "sgd"])
def test_cpu_offload_gives_identical_results(momentum_opt: str) -> None:
    def make_opt(ps):  # type: ignore[no-untyped-def]
        if momentum_opt == "adam":
            return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01)
        return torch.optim.SGD(ps, lr=0.1, momentum=0.9)

    plain, off = make_mlp(), make_mlp()
    opt_plain = dp_for(plain, make_opt(plain.parameters()))
    opt_off = dp_for(off, make_opt(off.parameters()), offload_state=True)
    for step in range(4):
        x, y = make_data(6, seed=30 + step)
        opt_plain.accumulate(clipped_sum_loop(plain, x, y))
        opt_off.accumulate(clipped_sum_loop(off, x, y))
        opt_plain.step()
        opt_off.step()
    assert_params_equal(plain, off)
    # the state lives on staging copies, not on the module's parameters
    live = {id(p) for p in off.parameters()}
    for group in opt_off.optimizer.param_groups:
        for p in group["params"]:
            assert id(p) not in live
            state = opt_off.optimizer.state[p]
            assert state
            assert all(
                v.device.type == "cpu" for v in state.values() if isinstance(v, torch.Tensor)
            )
    # offload and plain state dicts are interchangeable
    fresh = make_mlp()
    opt_fresh = dp_for(fresh, make_opt(fresh.parameters()))
    fresh.load_state_dict(off.state_dict())
    opt_fresh.load_state_dict(opt_off.state_dict())
    x, y = make_data(6, seed=99)
    for model, opt in ((plain, opt_plain), (fresh, opt_fresh)):
        opt.accumulate(clipped_sum_loop(model, x, y))
        opt.step()
    assert_params_equal(plain, fresh)


def test_offload_sees_parameters_changed_outside_the_optimizer() -> None:
    a, b = make_mlp(), make_mlp()
    opt_a = dp_for(a, torch.optim.Adam(a.parameters(), lr=1e-2))
    opt_b = dp_for(b, torch.optim.Adam(b.parameters(), lr=1e-2), offload_state=True)
    with torch.no_grad():
        for m in (a, b):
            m[0].weight.mul_(0.5)
    x, y = make_data(6)
    for m, o in ((a, opt_a), (b, opt_b)):
        o.accumulate(clipped_sum_loop(m, x, y))
        o.step()
    assert_params_equal(a, b)


# -- state ----------------------------------------------------------------------------------


def test_state_dict_round_trip_continues_bitwise() -> None:
    model = make_mlp()
    opt = dp_for(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    data = [make_data(5, seed=40 + i) for i in range(4)]
    for x, y in data[:2]:
        opt.accumulate(clipped_sum_loop(model, x, y))
        opt.step()
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    for x, y in data[2:]:
        opt.accumulate(clipped_sum_loop(model, x, y))
        opt.step()

    resumed = make_mlp(seed=7)  # different init, overwritten by the load
    resumed.load_state_dict(saved_model)
    opt2 = dp_for(resumed, torch.optim.Adam(resumed.parameters(), lr=1e-2), seed=999)
    opt2.load_state_dict(saved_opt)
    assert opt2.steps == 2
    for x, y in data[2:]:
        opt2.accumulate(clipped_sum_loop(resumed, x, y))
        opt2.step()
    assert_params_equal(model, resumed)


def test_state_dict_refused_mid_accumulation() -> None:
    model = make_mlp()
    opt = dp_for(model)
    x, y = make_data(3)
    opt.accumulate(clipped_sum_loop(model, x, y))
    with pytest.raises(OperationError, match="un-noised private data"):
        opt.state_dict()
    opt.zero_grad()
    assert opt.pending_batches == 0
    assert opt.state_dict()["steps"] == 0


def test_load_state_dict_validates() -> None:
    model = make_mlp()
    opt = dp_for(model)
    good = opt.state_dict()
    with pytest.raises(ConfigurationError, match="missing keys"):
        opt.load_state_dict({k: v for k, v in good.items() if k != "noise"})
    with pytest.raises(ConfigurationError, match="saved for parameters"):
        opt.load_state_dict({**good, "param_names": ["a", "b"]})
    with pytest.raises(ConfigurationError, match="version"):
        opt.load_state_dict({**good, "version": 99})
    with pytest.raises(ConfigurationError, match="steps"):
        opt.load_state_dict({**good, "steps": -1})
    with pytest.raises(ConfigurationError, match="unused_checked"):
        opt.load_state_dict({**good, "unused_checked": [1]})
    with pytest.raises(InputTypeError):
        opt.load_state_dict([1, 2])  # type: ignore[arg-type]


# -- bad input -------------------------------------------------------------------------------


def test_constructor_rejects_bad_input() -> None:
    model = make_mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    base = {"noise_multiplier": 1.0, "expected_batch_size": 4.0, "seed": 0}
    with pytest.raises(InputTypeError, match=r"torch\.optim\.Optimizer"):
        DPOptimizer("sgd", model, **base)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="not one of the tensors"):
        DPOptimizer(sgd, make_mlp(), **base)
    with pytest.raises(ConfigurationError, match="expected_batch_size"):
        DPOptimizer(sgd, model, **{**base, "expected_batch_size": 0})
    with pytest.raises(ConfigurationError, match="noise_multiplier"):
        DPOptimizer(sgd, model, **{**base, "noise_multiplier": -1.0})
    with pytest.raises(ConfigurationError, match="no noise_multiplier"):
        DPOptimizer(sgd, model, expected_batch_size=4.0)
    with pytest.raises(ConfigurationError, match="sample_rate"):
        DPOptimizer(sgd, model, **base, accountant=RecordingAccountant())
    with pytest.raises(ConfigurationError, match="sample_rate"):
        DPOptimizer(sgd, model, **base, sample_rate=1.5)
    with pytest.raises(ConfigurationError, match="delta"):
        DPOptimizer(sgd, model, **base, delta=1e-5)
    with pytest.raises(ConfigurationError, match="unused_params"):
        DPOptimizer(sgd, model, **base, unused_params="ignore")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="seed"):
        DPOptimizer(sgd, model, **base, noise=GaussianNoise(1.0, seed=1))
    with pytest.raises(ConfigurationError, match=r"noise_multiplier=2\.0"):
        DPOptimizer(
            sgd, model, noise_multiplier=2.0, expected_batch_size=4.0,
            noise=GaussianNoise(1.0, seed=1),
        )  # fmt: skip
    with pytest.raises(TypeError, match="clip"):
        DPOptimizer(sgd, model, **base, clip=1.0)  # type: ignore[call-arg]


def test_accumulate_and_step_reject_bad_input() -> None:
    model = make_mlp()
    opt = dp_for(model)
    x, y = make_data(3)
    good = clipped_sum_loop(model, x, y)
    with pytest.raises(OperationError, match="nothing accumulated"):
        opt.step()
    with pytest.raises(InputTypeError, match="max_norm"):
        opt.accumulate(dict(good))
    with pytest.raises(ConfigurationError, match="does not update"):
        opt.accumulate(ClippedSum({**good, "extra": torch.zeros(1)}, C))
    with pytest.raises(ConfigurationError, match="shape"):
        opt.accumulate(ClippedSum({**good, "0.bias": torch.zeros(3, 8)}, C))
    with pytest.raises(ConfigurationError, match="max_norm"):
        opt.accumulate(ClippedSum(dict(good), float("nan")))
    with pytest.raises(InputTypeError):
        opt.accumulate([1.0])  # type: ignore[arg-type]
    assert opt.pending_batches == 0  # nothing half-accumulated by a rejected call


def test_physical_batches_with_different_bounds_use_the_largest() -> None:
    model = make_mlp()
    opt = dp_for(model)
    x, y = make_data(4)
    opt.accumulate(clipped_sum_loop(model, x[:2], y[:2], clip=0.5))
    opt.accumulate(clipped_sum_loop(model, x[2:], y[2:], clip=0.25))
    assert opt.step().sensitivity == 0.5


def test_the_in_place_noised_step_hands_its_own_sum_to_the_parameters() -> None:
    # noised in place and divided in place: the step adds no gradient-sized buffer; the
    # fp32 parameters' .grad is the optimizer's own sum, finished where it lay
    model = make_mlp()
    opt = dp_for(model)
    x, y = make_data(4)
    opt.accumulate(clipped_sum_loop(model, x, y))
    where = {name: t.data_ptr() for name, t in opt._sums.items()}
    opt.step()
    for name, param in model.named_parameters():
        assert param.grad is not None
        assert param.grad.data_ptr() == where[name]


def test_the_in_place_noised_step_equals_the_out_of_place_one() -> None:
    # DPOptimizer noises its own fp32 sums in place; a GaussianNoise subclass overriding add()
    # takes the out-of-place path: the same seed must give the same parameters
    class OutOfPlace(GaussianNoise):
        def add(self, grads, sensitivity=None):  # type: ignore[no-untyped-def,override]
            return super().add(grads, sensitivity)

    x, y = make_data(6)
    results = []
    for noise in (GaussianNoise(SIGMA, seed=SEED), OutOfPlace(SIGMA, seed=SEED)):
        model = make_mlp()
        opt = dp_for(model, noise=noise)
        for _ in range(2):
            opt.accumulate(clipped_sum_loop(model, x, y))
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
