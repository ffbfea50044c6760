"""GPU check of data-parallel DP-SGD: two ranks on CUDA equal one process on CUDA.

    python tools/gpu/ddp_check.py                 # prints a JSON report, exit 1 on failure
    python tools/gpu/ddp_check.py --out ddp.json
    python tools/gpu/ddp_check.py --device cpu    # smoke run of the script itself (gloo, CPU)

Two ranks are started like ``torchrun`` would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
With ≥ 2 GPUs they use **nccl**, one GPU each; with one GPU both ranks share ``cuda:0`` and use
**gloo** (nccl refuses two ranks on one device), which still checks CUDA tensors, the CUDA noise
generator and the device moves. Each rank trains an MLP (hidden 512) for 4 DP-SGD steps on its
shard of the global Poisson batches (2 physical batches per step, microbatch 4) with
``DistributedDPOptimizer`` (seeded noise: replicated on every rank); the parent process trains
the same model on the global batches with ``DPOptimizer``. Checked: both ranks end bitwise
equal, within fp32 tolerance of the single process, and the per-rank ``step_perf`` figures
(CUDA peak memory) gather on every rank. With nccl, ``ShardedDPOptimizer`` over an FSDP2
``fully_shard``-ed copy is checked against the same reference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _two_ranks import rank_device, run_check, run_ranks, versus_single

N, Q, STEPS, SEED, NOISE_SEED = 64, 0.25, 4, 3, 7
SIGMA, CLIP, LR, HIDDEN = 0.8, 1.0, 0.2, 512


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 10)
    )


def _data(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, 32, generator=gen)
    y = torch.randint(0, 10, (N,), generator=gen)
    return x.to(device), y.to(device)


def _train(
    rank: int, world_size: int, device: torch.device, *, sharded: bool = False
) -> dict[str, torch.Tensor]:
    from opake.dpsgd.clipping import clipped_grad
    from opake.dpsgd.sampling import PoissonSampler
    from opake.functional import make_functional

    x, y = _data(device)
    model = _mlp().to(device)
    sampler = PoissonSampler(N, Q, seed=SEED, rank=rank, world_size=world_size)
    options: dict[str, Any] = {"noise_multiplier": SIGMA, "seed": NOISE_SEED, "sampler": sampler}
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from opake.dpsgd.distributed import (
            ShardedDPOptimizer,
            compute_template,
            gather_full_params,
        )

        fmodel, _ = make_functional(compute_template(model))
        mesh = init_device_mesh(device.type, (world_size,))
        fully_shard(model, mesh=mesh)
        opt: Any = ShardedDPOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model, **options)
    else:
        fmodel, params = make_functional(model)
        if world_size == 1:
            from opake.dpsgd.optimizer import DPOptimizer as Optimizer
        else:
            from opake.dpsgd.distributed import DistributedDPOptimizer as Optimizer  # type: ignore[assignment]
        opt = Optimizer(torch.optim.SGD(model.parameters(), lr=LR), model, **options)

    def loss_fn(p: Any, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(fmodel(p, xi[None]), yi[None])

    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=CLIP, batch_argnums=(1, 2), microbatch_size=4
    )
    for _, idx in zip(range(STEPS), sampler, strict=False):
        current = gather_full_params(model) if sharded else params
        rows = torch.tensor(idx, dtype=torch.long, device=device)
        half = (len(rows) + 1) // 2
        for part in (rows[:half], rows[half:]):
            grads, state = grad_fn(current, x[part], y[part], state=state)
            opt.accumulate(grads)
        opt.step()
    if sharded:
        return {n: t.detach().cpu() for n, t in gather_full_params(model).items()}
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def _rank_main(out: Path, device_kind: str) -> None:
    from opake.dpsgd.distributed import gather_metrics, init_distributed
    from opake.profiling import step_perf

    device, backend = rank_device(device_kind)
    with init_distributed(backend=backend, timeout=120, device=device) as ctx:
        with step_perf(device, batch_size=0) as perf:
            params = _train(ctx.rank, ctx.world_size, device)
        figures = gather_metrics(perf.result)
        result: dict[str, Any] = {"params": params, "backend": backend, "device": str(device)}
        result["metrics"] = {
            k: v for k, v in figures.to_dict().items() if "step_time" in k or "peak" in k
        }
        if backend == "nccl":
            result["sharded"] = _train(ctx.rank, ctx.world_size, device, sharded=True)
        torch.save(result, out / f"rank{ctx.rank}.pt")


def _check(args: argparse.Namespace, report: dict[str, Any]) -> bool:
    ranks = run_ranks(__file__, args.device, report)
    if ranks is None:
        return False
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    single = _train(0, 1, device)
    same, diff = versus_single(ranks, single)
    report.update(
        backend=ranks[0]["backend"],
        devices=[r["device"] for r in ranks],
        ranks_bitwise_equal=same,
        max_abs_diff_vs_single_process=diff,
        metrics=ranks[0]["metrics"],
    )
    ok = same and diff < 1e-5 and ranks[0]["metrics"] == ranks[1]["metrics"]
    if "sharded" in ranks[0]:
        sharded = max(float((ranks[0]["sharded"][n] - single[n]).abs().max()) for n in single)
        report["fsdp2_max_abs_diff_vs_single_process"] = sharded
        ok = ok and sharded < 1e-5
    return ok


def main(argv: list[str] | None = None) -> int:
    return run_check(__doc__, argv, rank_main=_rank_main, check=_check)


if __name__ == "__main__":
    sys.exit(main())
