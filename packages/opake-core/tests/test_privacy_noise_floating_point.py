"""Noise in floating point: the values a noised result can take must not reveal the gradient.

The attack class (Mironov 2012 for the Laplace mechanism; Jin et al. 2022 and Holohan & Braghin
2021 for Gaussian samplers): a floating-point mechanism ``x + noise`` can reach some outputs
from one true value ``x`` and not from another, so an output can say which ``x`` it came from,
whatever the noise's scale. ``docs/guide/privacy-noise.md`` gives the analysis these tests check:

* the fp32 addition the noise used to be added with leaks: where ``x + η`` cancels (|y| < |x|/2)
  the sum is exact and lies on the grid of ``x``'s spacing, so for ``x = 1`` every output in
  (−½, ½) is a multiple of 2⁻²⁴ while for ``x = 0`` most are not (the negative controls);
* the secure path returns ``Λ·rint(fl64(x/Λ + η/Λ))`` rounded once, with ``Λ = noise_grid(σS)``:
  a fixed function of the exact sum ``x + η``. Every output is a multiple of ``Λ`` for every
  ``x``, every lattice point near ``x`` is reachable, and the low-order bits of the outputs
  are distributed alike for ``x`` and ``x'``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from opake.dpsgd.noise import GaussianNoise, Randomness, add_noise, noise_grid
from opake.dpsgd.noise import _gaussian as _noise
from opake.dpsgd.optimizer import DPOptimizer
from opake.dpsgd.randomness import _source as _randomness

N = 1 << 18  # draws per value of x: the whole file runs in about a second


def mitigated(x: float, seed: int, std: float = 1.0, n: int = N) -> torch.Tensor:
    """What the secure path releases for a clipped-sum entry ``x`` (n independent draws)."""
    return GaussianNoise(std, seed=seed).add({"w": torch.full((n,), x)}, sensitivity=1.0)["w"]


def naive_fp32(x: float, seed: int, std: float = 1.0, n: int = N) -> torch.Tensor:
    """The broken sampler: fp32 noise added in fp32 (what Opake did before)."""
    z = Randomness.seeded(seed).normal("noise", 0, n)  # fp32
    return torch.full((n,), x) + z * std


def finest_power_of_two(values: torch.Tensor) -> float:
    """The largest power of two every value is an integer multiple of (the values' grid)."""
    v = values.double().numpy()
    mantissa, exponent = np.frexp(v[v != 0])  # v = mantissa·2^exponent, |mantissa| ∈ [½, 1)
    digits = np.abs(mantissa * 2.0**53).astype(np.int64)  # the 53-bit significand, exactly
    lowest = np.log2((digits & -digits).astype(np.float64))  # its trailing zero bits
    return float(2.0 ** np.min(exponent - 53 + lowest))


def low_bits_given_binade(a: torch.Tensor, b: torch.Tensor, bits: int = 3) -> tuple[float, int]:
    """A simple classifier's evidence: per fp32 binade (exponent field), the chi-square
    statistic of the low ``bits`` mantissa bits of ``a`` against ``b``, summed over binades
    (with its degrees of freedom). The binade itself is left out: how large an output is
    says what the continuous Gaussian mechanism allows; its last bits must say nothing more."""
    total, dof = 0.0, 0
    fa, fb = (t.contiguous().view(torch.int32).numpy() for t in (a, b))
    for e in np.intersect1d((fa >> 23) & 0xFF, (fb >> 23) & 0xFF):
        rows = []
        for f in (fa, fb):
            sel = f[((f >> 23) & 0xFF) == e]
            rows.append(np.bincount(sel & ((1 << bits) - 1), minlength=1 << bits))
        table = np.array(rows, dtype=np.float64)
        if table.sum(axis=1).min() < 40:
            continue
        table = table[:, table.sum(axis=0) > 0]
        if table.shape[1] < 2:
            continue  # one pattern only, the same for both: no evidence
        expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0) / table.sum()
        total += float(((table - expected) ** 2 / expected).sum())
        dof += table.shape[1] - 1
    return total, dof


# -- negative controls: the naive fp32 mechanism has holes that identify x ----------------


def test_naive_fp32_addition_has_holes_that_identify_x() -> None:
    # x = 1: where the output cancels to |y| < 1/2, Sterbenz makes 1 + η exact, and η there
    # (|η| ∈ (1/2, 3/2)) is a multiple of 2^-24: so is every output. x = 0: the output is η
    # itself, as fine-grained as fp32 is near 0.
    def detector(y: torch.Tensor) -> torch.Tensor:  # "this output cannot come from x = 1"
        y64 = y.double()
        return (y64.abs() < 0.5) & (torch.remainder(y64, 2.0**-24) != 0)

    from_one, from_zero = naive_fp32(1.0, seed=1), naive_fp32(0.0, seed=2)
    assert int(detector(from_one).sum()) == 0  # never wrong...
    rate = detector(from_zero).double().mean().item()
    assert rate > 0.2  # ...and right for about a quarter of all draws (0.26 measured)
    # the mitigated path, same detector: it never fires for either x
    assert int(detector(mitigated(1.0, seed=1)).sum()) == 0
    assert int(detector(mitigated(0.0, seed=2)).sum()) == 0


def test_naive_fp32_reachable_sets_differ_exhaustively() -> None:
    # every fp32 noise value that can land in a window of 4096 consecutive fp32 outputs from
    # 2^-12 on (spacing 2^-35): from x = 0 all 4096 are reachable, from x = 1 only the
    # multiples of 2^-24 among them (2^-12 and 2^-12 + 2^-24)
    y0 = torch.tensor(2.0**-12, dtype=torch.float32).view(torch.int32).item()
    window = torch.arange(y0, y0 + 4096, dtype=torch.int32).view(torch.float32)
    lo, hi = window[0].item(), window[-1].item()

    def reachable(x: float) -> set[float]:
        # all fp32 η with fl32(x + η) in [lo, hi]: η runs over consecutive fp32 values
        first = torch.tensor(lo - x - 2.0**-20, dtype=torch.float32).view(torch.int32).item()
        last = torch.tensor(hi - x + 2.0**-20, dtype=torch.float32).view(torch.int32).item()
        a, b = sorted((first, last))
        eta = torch.arange(a, b + 1, dtype=torch.int32).view(torch.float32)
        y = torch.tensor(x, dtype=torch.float32) + eta  # one fp32 rounding
        return {v for v in y.tolist() if lo <= v <= hi}

    assert len(reachable(0.0)) == 4096
    holes = set(window.tolist()) - reachable(1.0)
    assert len(holes) >= 4094


# -- the mitigation: one lattice for every x ------------------------------------------------


@pytest.mark.parametrize("std", [1.0, 0.3, 1e-4, 37.0])
def test_every_output_is_on_the_noise_lattice_whatever_x(std: float) -> None:
    grid = noise_grid(std)
    for i, x in enumerate([0.0, 2.0**-30, 1e-3, 0.1, 1 / 3, 1.0, -0.75]):
        y = mitigated(x * std, seed=10 + i, std=std, n=1 << 16)
        assert finest_power_of_two(y) == grid  # on the lattice, and no coarser subset of it
    # far from 0 the fp32 result is coarser than the lattice (fp32's own rounding of it)
    y = mitigated(2.0**20 * std, seed=9, std=std, n=1 << 16)
    assert finest_power_of_two(y) >= 2.0**20 * grid
    # the naive mechanism's grid near 0 depends on x: 2^-24 for x = 1, finer for x = 0
    near = [y[y.abs() < 0.25] for y in (naive_fp32(0.0, seed=3), naive_fp32(1.0, seed=3))]
    assert finest_power_of_two(near[1]) == 2.0**-24
    assert finest_power_of_two(near[0]) < 2.0**-30


def _combined(x: float, units: torch.Tensor, grid: float) -> torch.Tensor:
    dest = torch.full(units.shape, x, dtype=torch.float32)
    _noise._snap_add_(dest, units.clone(), grid)
    return dest


@pytest.mark.parametrize("x", [1.0, 0.0, 2.0**-28, -0.3, 1 / 3, 4097.0])
def test_every_lattice_point_near_the_output_is_reachable_from_every_x(x: float) -> None:
    # the combiner swept over noise values 1/64 of a lattice unit apart: every lattice point
    # (as fp32 rounds it) of a window where x + η cancels (around 0) and of one far from it is
    # reached, and nothing else. The sampler's own support is far denser (fp64 values).
    grid = noise_grid(1.0)

    def fp32_points(m0: int, half: int) -> set[float]:
        m = torch.arange(m0 - half, m0 + half + 1, dtype=torch.float64)
        return set((m * grid).float().tolist())

    for center in (0.0, x + 0.3, x + 2.5):
        m0 = round(center / grid)
        units = torch.arange(-40 * 64, 40 * 64, dtype=torch.float64) / 64 + (m0 - x / grid)
        got = set(_combined(x, units, grid).tolist())
        assert fp32_points(m0, 39) <= got
        assert got <= fp32_points(m0, 41)


def test_low_order_bits_say_nothing_about_x_beyond_the_gaussian() -> None:
    # a simple classifier (low mantissa bits, given the binade) over many draws: no evidence
    # for the mitigated path; overwhelming evidence for the naive one
    for x, x2 in [(0.0, 1.0), (0.3, 0.3 + 2.0**-20), (1.0, 0.25)]:
        stat, dof = low_bits_given_binade(mitigated(x, seed=20), mitigated(x2, seed=21))
        assert dof >= 14  # the binades where the fp32 spacing is finer than 8 lattice units
        assert stats.chi2.sf(stat, dof) > 1e-6
    stat, dof = low_bits_given_binade(naive_fp32(0.0, seed=20), naive_fp32(1.0, seed=21))
    assert stats.chi2.sf(stat, dof) < 1e-50


def test_the_result_is_a_function_of_the_exact_sum_only() -> None:
    # x/Λ + units (one rounding) equals (x + Λ·units)/Λ rounded: outputs agree for any two
    # splits of the same exact real sum into "gradient" and "noise"
    grid = noise_grid(1.0)
    gen = torch.Generator().manual_seed(0)
    units = torch.randn(4096, dtype=torch.float64, generator=gen) * 2.0**24
    x = torch.rand(4096, generator=gen) - 0.5  # fp32 gradients, |x| < 1/2
    shift = torch.randint(-(2**20), 2**20, (4096,), generator=gen).double()  # whole units
    a = x.clone()
    _noise._snap_add_(a, units.clone(), grid)
    # move a whole number of lattice units from the noise into the gradient (exact in fp32:
    # below 1 the fp32 spacing is at most 2^-24 = Λ)
    x2 = (x.double() + shift * grid).float()
    assert torch.equal(x2.double() - x.double(), shift * grid)
    b = x2.clone()
    _noise._snap_add_(b, units - shift, grid)
    assert torch.equal(a, b)


# -- the secure paths use the mitigated computation ------------------------------------------


def test_secure_paths_snap_onto_the_lattice(monkeypatch) -> None:
    calls: list[tuple[torch.dtype, float]] = []
    snap = _noise._snap_add_

    def recording(dest: torch.Tensor, units: torch.Tensor, grid: float) -> None:
        assert units.dtype == torch.float64  # the noise is fp64 when it is added
        calls.append((dest.dtype, grid))
        snap(dest, units, grid)

    monkeypatch.setattr(_noise, "_snap_add_", recording)
    grads = {"w": torch.full((1000,), 0.37), "v": torch.zeros(3, dtype=torch.float64)}
    out = GaussianNoise(1.3).add(grads, sensitivity=0.5)
    assert out.secure
    assert {dtype for dtype, _ in calls} == {torch.float32, torch.float64}
    assert {grid for _, grid in calls} == {noise_grid(0.65)}
    calls.clear()
    add_noise(grads, noise_multiplier=1.3, sensitivity=0.5)
    assert calls
    # DPOptimizer noises its own sum in place through the same path (divisor 1: .grad is it)
    calls.clear()
    w = torch.nn.Parameter(torch.zeros(512))
    opt = DPOptimizer(torch.optim.SGD([w], lr=0.0), {"w": w}, noise_multiplier=2.0,
                      expected_batch_size=1.0)  # fmt: skip

    class Sum(dict):  # type: ignore[type-arg]
        max_norm = 0.25

    opt.accumulate(Sum(w=torch.linspace(-0.1, 0.1, 512)))
    opt.step()
    assert calls
    assert {grid for _, grid in calls} == {noise_grid(0.5)}
    assert w.grad is not None
    assert finest_power_of_two(w.grad) >= noise_grid(0.5)


def test_fp64_box_muller_has_no_fp32_atoms_and_a_bounded_tail() -> None:
    # fp32 conversion made u = 1 (radius 0, output exactly x) for k ≥ 2^63 - 2^38 (2^-25 of all
    # draws); in fp64 only for k ≥ 2^63 - 2^9 (2^-54). The largest radius is sqrt(128 ln 2).
    k = np.array([2.0**63 - 2.0**38, 0.0, 2.0**63 - 1])
    j = np.array([0.0, 0.0, 0.0])
    cos_part, _ = _randomness._box_muller(k.copy(), j.copy(), 1.0)
    assert cos_part[0].item() == pytest.approx(math.sqrt(2 * 2.0**-25), rel=1e-6)
    assert cos_part[1].item() == pytest.approx(math.sqrt(128 * math.log(2)), rel=1e-12)
    assert cos_part[2].item() == 0.0
    k32 = torch.tensor(2.0**63 - 2.0**38, dtype=torch.float64).float()  # the fp32 conversion
    assert (k32 * 2.0**-63 + 2.0**-64).item() == 1.0
    y = mitigated(0.0, seed=30, n=1 << 16)
    assert y.abs().max().item() <= math.sqrt(128 * math.log(2)) + noise_grid(1.0)
