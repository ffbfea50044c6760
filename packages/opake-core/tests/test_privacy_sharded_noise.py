"""The sharded optimizer noises a sum as the single-process one does (red-team finding, round 4).

``ShardedDPOptimizer`` (FSDP2 levels 1 and 2, ``DPTraining(shard=True)``) used to snap its noise
onto the lattice Λ on its own and then add it to the clipped sum in fp32: the old computation of
``docs/guide/privacy-noise.md``, whose cancellation keeps the sum's low bits (from a sum of 0.1,
38 % of the released values were off the lattice, none from a sum of 0: the two neighbours told
apart with certainty). Now each rank snaps its rows of the noise into its rows of the sum,
``Λ·rint(fl64(x/Λ + b))``, exactly as ``GaussianNoise.add_`` does, with a shared key and with
rank 0's broadcast (which now sends the noise in lattice units, before any rounding).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from opake.dpsgd.noise import GaussianNoise, noise_grid

WORKER = Path(__file__).with_name("_sharded_noise_worker.py")


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_rows_noised_into_their_sum_equal_the_full_draw_bit_for_bit() -> None:
    x = {"b": torch.full((3,), 0.1), "w": torch.linspace(-1, 1, 40).reshape(10, 4)}
    full = GaussianNoise(1.0, seed=3).add(x, 1.0)
    draw = GaussianNoise(1.0, seed=3).draw_rows({n: v.shape for n, v in x.items()}, 1.0)
    for name, value in x.items():
        for start, stop in ((0, 2), (2, value.shape[0]), (1, 1)):
            rows = draw.add_rows_(name, start, value[start:stop].clone())
            assert torch.equal(rows, full[name][start:stop])
            units = draw.units(name, start, stop)  # b: what a broadcast sends
            assert units.dtype == torch.float64
            assert units.shape == value[start:stop].shape
    assert draw.grid == noise_grid(1.0)


def test_the_sharded_noise_on_unsharded_sums_is_the_single_process_noise() -> None:
    """The shared-key path of the sharded optimizer's noise (tensors FSDP does not shard need
    no collective): the released values lie on Λ from any sum, as GaussianNoise.add's do."""
    from opake.dpsgd.distributed._rows import _ShardedNoise

    grid = noise_grid(1.0)
    for x in (0.0, 0.1):
        sums = {"w": torch.full((1 << 14,), x)}
        noise = _ShardedNoise(
            GaussianNoise(1.0, seed=5), broadcast=False, group=None, device=torch.device("cpu")
        )
        out = noise.add(sums, 1.0)["w"]
        assert torch.equal(out, GaussianNoise(1.0, seed=5).add(sums, 1.0)["w"])
        units = out.double() / grid
        assert torch.equal(units, torch.round(units)), f"off the lattice from x = {x}"


@pytest.mark.slow
@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="this PyTorch build has no gloo backend",
)
def test_two_fsdp_ranks_release_only_lattice_values_and_the_single_process_draw(
    tmp_path: Path,
) -> None:
    ranks = _load("opake_test_ranks_noise", WORKER.with_name("_ranks.py"))
    command = [sys.executable, str(WORKER), str(tmp_path)]
    ranks.require_success(ranks.launch(command, world_size=2, timeout=180.0))
    result = json.loads((tmp_path / "result.json").read_text())
    off = {k: v for k, v in result.items() if k.startswith("off_lattice/")}
    assert off == dict.fromkeys(off, 0.0), off  # was 0.38 from x = 0.1 (shared and broadcast)
    assert len(off) == 4
    assert result["bitwise/shared"] is True
    assert result["bitwise/broadcast"] is True
