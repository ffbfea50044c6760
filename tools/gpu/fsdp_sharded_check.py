"""GPU check of FSDP2 level 2 (per-layer sharded compute) on nccl: two ranks equal one process.

    python tools/gpu/fsdp_sharded_check.py                # prints a JSON report, exit 1 on failure
    python tools/gpu/fsdp_sharded_check.py --out fsdp_sharded.json
    python tools/gpu/fsdp_sharded_check.py --device cpu   # smoke run of the script itself (gloo)

Needs ≥ 2 GPUs: two ranks, one GPU each, **nccl** (``fully_shard`` over a 1-D CUDA mesh). With
fewer it prints a JSON report with ``"skipped"`` and exits 0 (nccl refuses two ranks on one
device; level 2 on gloo is covered by the CPU test suite). The ranks are started like
``torchrun`` would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Each rank trains a tiny Llama
(``LlamaForCausalLM`` from a config: hidden 64, 2 layers, vocab 128; decoder layers, head and
root ``fully_shard``-ed) for 3 DP-SGD steps on its Poisson shard of the global batches with
``sharded_clipped_grad`` + ``ShardedDPOptimizer`` (SGD, seeded noise). The parent trains the same
model on CUDA in one process on the global batches: ``clipped_grad(engine="bookkeeping")`` +
``DPOptimizer``. Checked: both ranks hold the same gathered parameters, within fp32 tolerance
of the single process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from _two_ranks import rank_device, run_check, run_ranks, versus_single

N, Q, STEPS, SEQ, SEED, NOISE_SEED = 32, 0.25, 3, 16, 3, 7
SIGMA, CLIP, LR = 0.8, 1.0, 0.5


def _model(device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    options: dict[str, Any] = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 128,
        "max_position_embeddings": SEQ,
        "attn_implementation": "eager",
    }
    torch.manual_seed(0)
    model: torch.nn.Module = LlamaForCausalLM(LlamaConfig(**options))
    return model.to(device)


def _data(device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (N, SEQ), generator=gen).to(device)


def _losses(run: Any) -> Any:
    from opake.dpsgd.bookkeeping import causal_lm_losses

    def losses(*args: Any) -> torch.Tensor:
        ids = args[-1]
        return causal_lm_losses(run(*args[:-1], input_ids=ids, use_cache=False).logits, ids)

    return losses


def _options(sampler: Any) -> dict[str, Any]:
    return {"noise_multiplier": SIGMA, "seed": NOISE_SEED, "sampler": sampler}


def _sharded(rank: int, world_size: int, device: torch.device) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from opake.dpsgd.distributed import (
        ShardedDPOptimizer,
        gather_full_params,
        sharded_clipped_grad,
    )
    from opake.dpsgd.sampling import PoissonSampler

    ids = _data(device)
    model: Any = _model(device)
    mesh = init_device_mesh(device.type, (world_size,))
    for unit in [*model.model.layers, model.lm_head]:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sampler = PoissonSampler(N, Q, seed=SEED, rank=rank, world_size=world_size)
    opt = ShardedDPOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model, **_options(sampler))
    grad_fn, state = sharded_clipped_grad(
        _losses(model), model, clipping_norm=CLIP, microbatch_size=4
    )
    for _, idx in zip(range(STEPS), sampler, strict=False):
        rows = torch.tensor(idx, dtype=torch.long, device=device)
        grads, state = grad_fn(ids[rows], state=state)
        opt.accumulate(grads)
        opt.step()
    params = {n: t.detach().cpu() for n, t in gather_full_params(model).items()}
    return {"params": params, "engine": grad_fn.engine}


def _single(device: torch.device) -> dict[str, torch.Tensor]:
    from opake.dpsgd.bookkeeping import BatchedLoss
    from opake.dpsgd.clipping import clipped_grad
    from opake.dpsgd.optimizer import DPOptimizer
    from opake.dpsgd.sampling import PoissonSampler
    from opake.functional import make_functional

    ids = _data(device)
    model = _model(device)
    fmodel, params = make_functional(model)
    sampler = PoissonSampler(N, Q, seed=SEED)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model, **_options(sampler))
    grad_fn, state = clipped_grad(
        BatchedLoss(_losses(fmodel), fmodel),
        clipping_norm=CLIP,
        batch_argnums=1,
        microbatch_size=4,
        engine="bookkeeping",
    )
    for _, idx in zip(range(STEPS), sampler, strict=False):
        rows = torch.tensor(idx, dtype=torch.long, device=device)
        grads, state = grad_fn(params, ids[rows], state=state)
        opt.accumulate(grads)
        opt.step()
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def _rank_main(out: Path, device_kind: str) -> None:
    from opake.dpsgd.distributed import init_distributed

    device, backend = rank_device(device_kind)  # CUDA: >= 2 GPUs, nccl
    with init_distributed(backend=backend, timeout=120, device=device) as ctx:
        result = _sharded(ctx.rank, ctx.world_size, device)
        result.update(backend=backend, device=str(device))
        torch.save(result, out / f"rank{ctx.rank}.pt")


def _check(args: argparse.Namespace, report: dict[str, Any]) -> bool:
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        count = torch.cuda.device_count()
        report["skipped"] = f"needs 2 GPUs for nccl, found {count}: level 2 not checked on CUDA"
        return True
    ranks = run_ranks(__file__, args.device, report)
    if ranks is None:
        return False
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    single = _single(device)
    same, diff = versus_single(ranks, single)
    report.update(
        backend=ranks[0]["backend"],
        devices=[r["device"] for r in ranks],
        engine=ranks[0]["engine"],
        ranks_equal=same,
        max_abs_diff_vs_single_process=diff,
    )
    return same and diff < 1e-5 and ranks[0]["engine"] == "bookkeeping"


def main(argv: list[str] | None = None) -> int:
    return run_check(__doc__, argv, rank_main=_rank_main, check=_check)


if __name__ == "__main__":
    sys.exit(main())
