"""Tests for opake.dpsgd.noise: calibration, dtype, reproducibility, secure mode, state."""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest
import torch
from scipy import stats

from opake.core.errors import ConfigurationError, InputTypeError
from opake.dpsgd.noise import GaussianNoise, NoisyGrads, Randomness, add_noise, noise_grid


class Clipped(dict):
    """Stand-in for clipped_grad's result: a dict carrying its L2 sensitivity."""

    max_norm = 0.7


def _zeros(n: int = 8, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(n, dtype=dtype), "b": torch.zeros(2, 3, dtype=dtype)}


def test_empirical_std_matches_sigma_times_c() -> None:
    sigma, c, n = 1.3, 0.7, 200_000
    out = GaussianNoise(sigma, seed=1234).add(Clipped(w=torch.zeros(n)))
    assert out.noise_std == pytest.approx(sigma * c)
    x = out["w"].double().numpy()
    # For n i.i.d. N(0, s²) draws, (n-1)·ŝ²/s² ~ χ²(n-1), so ŝ/s ≈ N(1, 1/(2n)); sd ≈ 0.0016
    # here. 6 standard deviations (two-sided p ≈ 2e-9) cannot be hit by a correct sampler and
    # still catches a σ off by 1 %. The mean is N(0, s²/n): same 6-sd rule.
    rel_sd = 1.0 / math.sqrt(2 * n)
    assert abs(x.std(ddof=1) / (sigma * c) - 1.0) < 6 * rel_sd
    assert abs(x.mean()) < 6 * sigma * c / math.sqrt(n)
    # Shape: a Kolmogorov-Smirnov test against N(0, (σC)²); fixed seed, so deterministic.
    assert stats.kstest(x, "norm", args=(0.0, sigma * c)).pvalue > 1e-3


def test_noise_is_independent_across_entries_and_steps() -> None:
    n = 50_000
    noise = GaussianNoise(1.0, seed=3)
    first = noise.add({"a": torch.zeros(n), "b": torch.zeros(n)}, sensitivity=1.0)
    second = noise.add({"a": torch.zeros(n), "b": torch.zeros(n)}, sensitivity=1.0)
    # Sample correlation of independent normals ~ N(0, 1/n): 6/sqrt(n) is a 6-sd bound.
    bound = 6 / math.sqrt(n)
    for x, y in [(first["a"], first["b"]), (first["a"], second["a"])]:
        r = np.corrcoef(x.numpy(), y.numpy())[0, 1]
        assert abs(r) < bound


def test_matches_plain_reference_draw() -> None:
    # The obvious reference: one keystream per call, entries in sorted key order, the noise
    # σS·z in fp64 in units of the lattice Λ, added to x/Λ in fp64, rounded to an integer,
    # times Λ, rounded once to the result's dtype.
    grads = {"z": torch.randn(5), "a": torch.randn(2, 2), "d": torch.randn(3).double()}
    out = GaussianNoise(0.5, seed=11, device="cpu").add(grads, sensitivity=3.0)
    grid = noise_grid(1.5)
    assert grid == 2.0**-24
    units = Randomness.seeded(11).normal("noise", 0, 12, dtype=torch.float64, scale=1.5 / grid)
    parts = {"a": units[:4].view(2, 2), "d": units[4:7], "z": units[7:]}
    assert list(out) == list(grads)  # key order of the input is kept
    for name, value in grads.items():
        want = ((value.double() / grid + parts[name]).round() * grid).to(out[name].dtype)
        torch.testing.assert_close(out[name], want, rtol=0, atol=0)
        assert out[name].dtype == (torch.float64 if name == "d" else torch.float32)
    # the noise itself is σS·z to within the lattice (plus fp32's rounding)
    noise = out["z"].double() - grads["z"].double()
    assert torch.allclose(noise, units[7:] * grid, rtol=0, atol=grid + 2.0**-21)


def test_noise_grid_is_a_power_of_two_fixed_by_the_noise_alone() -> None:
    for std in (1.0, 0.75, 1e-9, 37.0, 2.0**-100, 3.0 * 2.0**90):
        grid = noise_grid(std)
        mantissa, _ = math.frexp(grid)
        assert mantissa == 0.5  # a power of two
        assert std * 2.0**-25 < grid <= std * 2.0**-24  # half the fp32 spacing at σS
    with pytest.raises(ConfigurationError, match="noise_std"):
        noise_grid(0.0)
    with pytest.raises(ConfigurationError, match="noise_std"):
        noise_grid(float("inf"))
    with pytest.raises(ConfigurationError, match="noise_std"):
        noise_grid(1e-300)
    with pytest.raises(InputTypeError):
        noise_grid("1.0")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_noise_is_added_in_fp32_whatever_the_grad_dtype(dtype: torch.dtype) -> None:
    grads = {"w": torch.full((1000,), 0.1, dtype=dtype)}
    out = GaussianNoise(1e-3, seed=0).add(grads, sensitivity=1.0)
    assert out["w"].dtype == torch.float32
    noise = out["w"] - grads["w"].float()
    # A std of 1e-3 would be lost entirely to bf16 rounding near 0.1 (spacing 2^-11 ≈ 5e-4).
    assert noise.std().item() == pytest.approx(1e-3, rel=0.15)


def test_float64_grads_get_float64_noise() -> None:
    out = GaussianNoise(1.0, seed=0).add({"w": torch.zeros(4, dtype=torch.float64)}, 1.0)
    assert out["w"].dtype == torch.float64


def test_seeded_reproducible_and_seed_sensitive() -> None:
    a = GaussianNoise(1.0, seed=42).add(_zeros(), sensitivity=1.0)
    b = GaussianNoise(1.0, seed=42).add(_zeros(), sensitivity=1.0)
    c = GaussianNoise(1.0, seed=43).add(_zeros(), sensitivity=1.0)
    assert torch.equal(a["w"], b["w"])
    assert torch.equal(a["b"], b["b"])
    assert not torch.equal(a["w"], c["w"])


def test_same_key_same_noise_whatever_dict_order() -> None:
    # Ranks build their gradient dicts independently: the draw must not depend on key order.
    x = GaussianNoise(1.0, seed=5).add({"a": torch.zeros(3), "b": torch.zeros(3)}, 1.0)
    y = GaussianNoise(1.0, seed=5).add({"b": torch.zeros(3), "a": torch.zeros(3)}, 1.0)
    assert torch.equal(x["a"], y["a"])
    assert torch.equal(x["b"], y["b"])


def test_state_dict_resume_continues_the_stream() -> None:
    full = GaussianNoise(1.0, seed=9)
    draws = [full.add(_zeros(), sensitivity=1.0)["w"] for _ in range(4)]

    part = GaussianNoise(1.0, seed=9)
    for _ in range(2):
        part.add(_zeros(), sensitivity=1.0)
    state = json.loads(json.dumps(part.state_dict()))  # JSON round trip
    resumed = GaussianNoise(1.0, seed=0)
    resumed.load_state_dict(state)
    assert resumed.calls == 2
    assert resumed.seed == 9
    assert torch.equal(resumed.add(_zeros(), sensitivity=1.0)["w"], draws[2])
    assert torch.equal(resumed.add(_zeros(), sensitivity=1.0)["w"], draws[3])


def test_default_is_secure_and_stores_no_key() -> None:
    noise = GaussianNoise(1.0)
    assert noise.secure
    assert noise.seed is None
    assert noise.mode == "secure"
    noise.add(_zeros(), sensitivity=1.0)
    state = noise.state_dict()
    assert state == {
        "version": 2,
        "noise_multiplier": 1.0,
        "secure": True,
        "seed": None,
        "calls": 1,
    }
    assert noise.randomness.export_key().hex() not in json.dumps(state)


def test_secure_mode_differs_run_to_run_and_keeps_no_replayable_state() -> None:
    a = GaussianNoise(1.0, secure=True)
    b = GaussianNoise(1.0)
    x1 = a.add(_zeros(64), sensitivity=1.0)["w"]
    x2 = a.add(_zeros(64), sensitivity=1.0)["w"]
    y1 = b.add(_zeros(64), sensitivity=1.0)["w"]
    assert not torch.equal(x1, x2)
    assert not torch.equal(x1, y1)
    state = a.state_dict()
    assert state["seed"] is None
    assert a.add(_zeros(), sensitivity=1.0).secure
    # a resumed secure noise continues the count with its own, fresh key
    resumed = GaussianNoise(1.0)
    resumed.load_state_dict(state)
    assert resumed.calls == a.calls - 1
    assert not torch.equal(resumed.add(_zeros(64), sensitivity=1.0)["w"], x1)
    # Still calibrated: 64·3 calls' worth is too few; draw one large tensor.
    big = b.add({"w": torch.zeros(100_000)}, sensitivity=2.0)["w"]
    assert big.std().item() == pytest.approx(2.0, rel=6 / math.sqrt(2 * 100_000))


def test_functional_add_noise() -> None:
    grads = Clipped(w=torch.zeros(6))
    gen = torch.Generator().manual_seed(21)
    out = add_noise(grads, noise_multiplier=2.0, generator=gen)
    assert isinstance(out, NoisyGrads)
    assert out.sensitivity == pytest.approx(0.7)
    assert out.noise_std == pytest.approx(1.4)
    assert not out.secure
    ref = torch.randn(6, generator=torch.Generator().manual_seed(21)) * 1.4
    torch.testing.assert_close(out["w"], ref, rtol=0, atol=0)
    seeded = add_noise(grads, noise_multiplier=2.0, seed=21)
    assert not seeded.secure
    assert torch.equal(seeded["w"], GaussianNoise(2.0, seed=21).add(grads)["w"])
    secure = add_noise(grads, noise_multiplier=2.0)
    assert secure.secure
    assert not torch.equal(secure["w"], out["w"])
    with pytest.raises(ConfigurationError, match="both"):
        add_noise(grads, noise_multiplier=2.0, seed=1, generator=gen)


def test_sensitivity_sources_and_conflicts() -> None:
    noise = GaussianNoise(1.0, seed=0)
    assert noise.add(Clipped(w=torch.zeros(2))).sensitivity == pytest.approx(0.7)
    assert noise.last_noise_std == pytest.approx(0.7)
    assert noise.add(Clipped(w=torch.zeros(2)), sensitivity=0.7).sensitivity == pytest.approx(0.7)
    with pytest.raises(ConfigurationError, match="disagrees"):
        noise.add(Clipped(w=torch.zeros(2)), sensitivity=1.0)
    with pytest.raises(ConfigurationError, match="no sensitivity"):
        noise.add({"w": torch.zeros(2)})
    with pytest.raises(ConfigurationError, match="sensitivity"):
        noise.add({"w": torch.zeros(2)}, sensitivity=0.0)
    with pytest.raises(InputTypeError):
        noise.add({"w": torch.zeros(2)}, sensitivity="big")  # type: ignore[arg-type]
    tensor_norm = Clipped(w=torch.zeros(2))
    tensor_norm.max_norm = torch.tensor(0.25)  # type: ignore[assignment]
    assert noise.add(tensor_norm).noise_std == pytest.approx(0.25)


@pytest.mark.parametrize("sigma", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_noise_multiplier(sigma: float) -> None:
    with pytest.raises(ConfigurationError, match="noise_multiplier"):
        GaussianNoise(sigma)
    with pytest.raises(ConfigurationError, match="noise_multiplier"):
        add_noise({"w": torch.zeros(1)}, noise_multiplier=sigma, sensitivity=1.0)


def test_bad_inputs_raise_typed_errors() -> None:
    with pytest.raises(InputTypeError):
        GaussianNoise("1.0")  # type: ignore[arg-type]
    with pytest.raises(InputTypeError):
        GaussianNoise(True)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="secure"):
        GaussianNoise(1.0, seed=1, secure=True)
    with pytest.raises(ConfigurationError, match="explicitly"):
        GaussianNoise(1.0, secure=False)
    with pytest.raises(ConfigurationError, match="both"):
        GaussianNoise(1.0, seed=1, randomness=Randomness.secure())
    with pytest.raises(InputTypeError):
        GaussianNoise(1.0, randomness=7)  # type: ignore[arg-type]
    with pytest.raises(InputTypeError):
        GaussianNoise(1.0, seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(InputTypeError):
        GaussianNoise(1.0, seed=-1)
    with pytest.raises(InputTypeError):
        GaussianNoise(1.0, device=3.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        GaussianNoise(1.0, sede=1)  # type: ignore[call-arg]
    noise = GaussianNoise(1.0, seed=0)
    with pytest.raises(InputTypeError):
        noise.add([torch.zeros(1)], sensitivity=1.0)  # type: ignore[arg-type]
    with pytest.raises(InputTypeError):
        noise.add({"w": [0.0]}, sensitivity=1.0)  # type: ignore[dict-item]
    with pytest.raises(InputTypeError, match="floating"):
        noise.add({"w": torch.zeros(2, dtype=torch.int64)}, sensitivity=1.0)
    with pytest.raises(InputTypeError):
        add_noise({"w": torch.zeros(1)}, noise_multiplier=1.0, sensitivity=1.0, generator=3)  # type: ignore[arg-type]


def test_load_state_dict_validation() -> None:
    noise = GaussianNoise(1.0, seed=0)
    with pytest.raises(ConfigurationError, match="lacks"):
        noise.load_state_dict({"seed": 1})
    with pytest.raises(ConfigurationError, match="secure"):
        noise.load_state_dict(GaussianNoise(1.0, secure=True).state_dict())
    with pytest.raises(ConfigurationError, match="seeded"):
        GaussianNoise(1.0).load_state_dict(noise.state_dict())
    bad_version = {**noise.state_dict(), "version": 99}
    with pytest.raises(ConfigurationError, match="version"):
        noise.load_state_dict(bad_version)
    with pytest.raises(InputTypeError):
        noise.load_state_dict([1, 2])  # type: ignore[arg-type]


def test_noise_multiplier_setter_and_pickle() -> None:
    noise = GaussianNoise(1.0, seed=0)
    noise.noise_multiplier = 2.5
    out = noise.add({"w": torch.zeros(3)}, sensitivity=2.0)
    assert out.noise_std == pytest.approx(5.0)
    with pytest.raises(ConfigurationError):
        noise.noise_multiplier = 0.0
    clone = pickle.loads(pickle.dumps(out))
    assert isinstance(clone, NoisyGrads)
    assert clone.noise_std == pytest.approx(5.0)
    assert torch.equal(clone["w"], out["w"])
    assert "seed=0" in repr(noise)


def test_empty_grad_dict_is_fine() -> None:
    out = GaussianNoise(1.0, seed=0).add({}, sensitivity=1.0)
    assert out == {}
    assert out.noise_std == 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_gradients_get_the_cpu_drawn_noise() -> None:
    grads = {"w": torch.zeros(1000, device="cuda")}
    a = GaussianNoise(1.0, seed=4)
    first = a.add(grads, sensitivity=1.0)["w"]
    assert first.device.type == "cuda"
    cpu = GaussianNoise(1.0, seed=4).add({"w": torch.zeros(1000)}, sensitivity=1.0)["w"]
    assert torch.equal(first.cpu(), cpu)  # drawn on the CPU, moved to the gradient's device


def test_in_place_noise_is_the_same_draw_added_to_the_tensors_themselves() -> None:
    def grads():
        return {
            "z": torch.arange(12.0).reshape(3, 4),
            "a": torch.full((5,), -2.0, dtype=torch.float64),  # one fp64 entry: drawn in fp64
            "m": torch.zeros(0),
        }

    want = GaussianNoise(1.5, seed=4).add(grads(), sensitivity=0.7)
    sums = grads()
    ids = {name: id(t) for name, t in sums.items()}
    noise = GaussianNoise(1.5, seed=4)
    got = noise.add_(sums, sensitivity=0.7)
    assert noise.calls == 1
    assert noise.last_noise_std == pytest.approx(1.05)
    assert got.noise_std == want.noise_std
    assert list(got) == list(want)
    for name in want:
        assert id(got[name]) == ids[name]
        assert got[name] is sums[name]
        assert got[name].dtype == want[name].dtype
        assert torch.equal(got[name], want[name])
    # what cannot be noised in place is refused, and nothing is changed
    for bad in (torch.zeros(3, dtype=torch.bfloat16), torch.zeros(4, 3).t()):
        before = bad.clone()
        with pytest.raises(InputTypeError, match="in-place noise needs contiguous fp32"):
            GaussianNoise(1.0, seed=0).add_({"w": bad}, sensitivity=1.0)
        assert torch.equal(bad, before)
