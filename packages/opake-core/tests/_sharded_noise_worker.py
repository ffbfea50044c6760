"""Worker of ``test_privacy_sharded_noise.py``: one FSDP2 step whose released values are read.

``RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python _sharded_noise_worker.py OUTDIR``:
a ``fully_shard``-ed module of one ``[n, 4]`` parameter and a bias, starting at zero, one
``ShardedDPOptimizer`` step (SGD, lr 1, ``q·N = 1``) on a clipped sum ``x`` that rank 0 holds
(rank 1 adds zeros), so the parameters become ``−(x + noise)``; for each noise mode (secure
shared key, secure broadcast, seeded shared key, seeded broadcast) and ``x`` in {0, 0.1}. Rank 0
writes ``OUTDIR/result.json``: the fraction of released values off the lattice Λ, and whether
the seeded runs equal the single-process ``GaussianNoise.add`` of ``x`` bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

N = 1 << 12
SEED = 7


def _step(sync: str, seed: int | None, x: float) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from opake.dpsgd.clipping import ClippedGrads
    from opake.dpsgd.distributed import ShardedDPOptimizer

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(N, 4))
    model.b = torch.nn.Parameter(torch.zeros(3))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    options: dict[str, object] = {"noise_multiplier": 1.0, "expected_batch_size": 1.0}
    if seed is not None:
        options["seed"] = seed
    if sync == "broadcast":
        options["noise_sync"] = "broadcast"
    opt = ShardedDPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model, **options)
    value = x if dist.get_rank() == 0 else 0.0
    sums = {"b": torch.full((3,), value), "w": torch.full((N, 4), value)}
    opt.accumulate(ClippedGrads(sums, max_norm=1.0, batch_size=1))
    opt.step()
    return {n: -p.full_tensor().detach() for n, p in model.named_parameters()}


def _off_lattice(values: dict[str, torch.Tensor], grid: float) -> float:
    flat = torch.cat([v.reshape(-1).double() for v in values.values()]) / grid
    return float((flat != torch.round(flat)).double().mean())


def main(out: Path) -> None:
    from opake.dpsgd.noise import GaussianNoise, noise_grid

    dist.init_process_group("gloo")
    result: dict[str, object] = {}
    try:
        for sync in ("shared", "broadcast"):
            for x in (0.0, 0.1):
                released = _step(sync, None, x)
                result[f"off_lattice/{sync}/{x}"] = _off_lattice(released, noise_grid(1.0))
            seeded = _step(sync, SEED, 0.1)
            full = {"b": torch.full((3,), 0.1), "w": torch.full((N, 4), 0.1)}
            want = GaussianNoise(1.0, seed=SEED).add(full, 1.0)
            result[f"bitwise/{sync}"] = all(torch.equal(seeded[n], want[n]) for n in want)
    finally:
        dist.destroy_process_group()
    if int(__import__("os").environ["RANK"]) == 0:
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
