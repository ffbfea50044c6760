"""Regression tests of a red-team finding: an fp64 per-example gradient rounded to fp32 *before*
it is scaled by its clip factor.

The vmap engine used to convert each fp64 gradient to fp32 and only then multiply it by the
factor. In fp32's subnormal range that conversion has an absolute error (up to 2⁻¹⁵⁰ per
entry) which the proof counted as relative; with AUTO-S and a tiny ``stability`` the factor is
about 2¹²⁵, so the error grew with it: 1 + 2u of R with 16 entries, 1.00012·R with 2²⁰. Now an
fp64 gradient is scaled and summed in fp64 and rounded to fp32 once (proof, section 2), on the
eager path, the compiled path's products and the torch reference of ``clip_accumulate``.
Each test isolates one example's contribution and checks it against the exact oracle.
"""

from __future__ import annotations

import pytest
import torch

from opake.core import testing
from opake.dpsgd.clipping import AutoSClipping, _vmap_engine, clipped_grad
from opake.dpsgd.clipping import _kernel as core_kernel

EXACT = 1.0 + 1e-12  # the oracle's own fp64 rounding: nothing else is tolerated
# every entry (m + ½ + ε)·2⁻¹⁴⁹ rounds *up* when converted to fp32
CRAFTED = (2.0**20 + 0.5 + 2.0**-10) * 2.0**-149


def _loss(p: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return (p["w"] * y).sum()  # the per-example gradient is y itself


def _worst(n: int, batch: int = 2) -> float:
    grad_fn, state = clipped_grad(
        _loss,
        clipping_norm=AutoSClipping(1.0, stability=1e-300),
        batch_argnums=(1,),
        engine="vmap",
    )
    params = {"w": torch.zeros(n, dtype=torch.float64)}
    grad_fn(params, torch.randn(batch, n, dtype=torch.float64), state=state)  # benign first
    y = torch.randn(batch, n, dtype=torch.float64)
    y[0] = CRAFTED
    got = testing.contribution(grad_fn, (params, y), state=state, index=0, batch=batch)
    assert got["w"].dtype == torch.float32
    return testing.exact_norm(got)


@pytest.mark.parametrize("n", [16, 1 << 16])
def test_auto_s_with_fp64_subnormal_gradients_stays_within_r(n):
    norm = _worst(n)
    assert 0.99 < norm <= 1.0 * EXACT, norm


def test_the_compiled_paths_products_scale_fp64_first(monkeypatch):
    # the branch torch.compile traces (products and sums, no matrix product), run eagerly
    monkeypatch.setattr(_vmap_engine, "compiling", lambda: True)
    norm = _worst(1 << 12)
    assert 0.99 < norm <= 1.0 * EXACT, norm


def test_the_torch_path_of_clip_accumulate_scales_fp64_first():
    grads = [torch.full((2, 64), CRAFTED, dtype=torch.float64)]
    factors = torch.tensor([[2.0**125], [0.0]])
    want = torch.full((64,), CRAFTED * 2.0**125, dtype=torch.float64).float()
    for run in (core_kernel.torch_clip_accumulate,):
        sums = [torch.zeros(64)]
        run(grads, factors, sums)
        assert torch.equal(sums[0], want)
    # the fp32 conversion first would have added 2⁻¹⁵⁰·2¹²⁵ per entry too many
    assert float(want[0]) < float(grads[0][0, 0].float()) * 2.0**125
