"""One rank of test_privacy_sharded_checkpoint.py: sharded checkpoints that do not hang together.

``RANK=r WORLD_SIZE=2 ... python _sharded_tamper_worker.py tamper OUTDIR``. Two seeded runs
of ``_sharded_worker.py``'s tiny Llama (AdamW, noise seeds 11 and 99) save sharded
checkpoints: run 1 after steps 2 (A) and 3 (B), run 2 after step 2 (C). Then, into fresh runs:

- ``mixed``: rank 0 loads A, rank 1 loads C (a stale copy of another run on one node);
- ``swapped``: A with rank 1's shard file replaced by B's (another step's shard in the folder);
- ``rewound``: run 1 (at step 3, secure noise) loads its own step-2 checkpoint;
- ``whole``: A into a fresh run, untouched (must load).

Each records whether the load raised (on this rank) and whether the model's parameters or the
accountant changed.
"""

from __future__ import annotations

import os
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _sharded_worker as W


def _build(rank: int, world_size: int, noise_seed: int | None) -> dict[str, Any]:
    from opake.accounting import RDPAccountant
    from opake.dpsgd.distributed import ShardedDPOptimizer, sharded_clipped_grad
    from opake.dpsgd.sampling import PoissonSampler

    model = W.make_model()
    W.shard(model, world_size)
    sampler = PoissonSampler(W.N, W.Q, seed=W.SAMPLER_SEED, rank=rank, world_size=world_size)
    accountant = RDPAccountant()
    opt = ShardedDPOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.05),
        model,
        sampler=sampler,
        accountant=accountant,
        delta=1e-5,
        noise_multiplier=W.SIGMA,
        seed=noise_seed,
    )
    grad_fn, state = sharded_clipped_grad(
        W.losses_of(model), model, clipping_norm=W.CLIP, microbatch_size=2
    )
    return {"model": model, "sampler": sampler, "accountant": accountant, "opt": opt,
            "fn": grad_fn, "state": state}  # fmt: skip


def _steps(run: dict[str, Any], count: int) -> None:
    ids = W.data()
    for _, idx in zip(range(count), run["sampler"], strict=False):
        for part in W._halves(idx):
            grads, run["state"] = run["fn"](ids[torch.tensor(part, dtype=torch.long)],
                                             state=run["state"])  # fmt: skip
            run["opt"].accumulate(grads)
        run["opt"].step()


def _save(run: dict[str, Any], directory: Path, step: int) -> None:
    from opake.dpsgd.distributed import save_sharded_checkpoint

    save_sharded_checkpoint(directory, step=step, model=run["model"], optimizer=run["opt"],
                            accountant=run["accountant"], sampler=run["sampler"],
                            clip_state=run["state"])  # fmt: skip


def _try_load(run: dict[str, Any], directory: Path) -> dict[str, Any]:
    from opake.core.errors import OpakeError
    from opake.dpsgd.distributed import gather_full_params, load_sharded_checkpoint

    before = {n: t.clone() for n, t in gather_full_params(run["model"]).items()}
    steps = run["accountant"].steps
    try:
        load_sharded_checkpoint(directory, model=run["model"], optimizer=run["opt"],
                                accountant=run["accountant"], sampler=run["sampler"])  # fmt: skip
        error = None
    except OpakeError as err:
        error = f"{type(err).__name__}: {err}"
    after = gather_full_params(run["model"])
    changed = any(not torch.equal(before[n], t) for n, t in after.items())
    return {"error": error, "changed": changed, "steps": (steps, run["accountant"].steps)}


def tamper(rank: int, world_size: int, out: Path) -> dict[str, Any]:
    import torch.distributed as dist

    first, second = _build(rank, world_size, 11), _build(rank, world_size, 99)
    _steps(first, 2)
    _save(first, out / "A", 2)
    _steps(first, 1)
    _save(first, out / "B", 3)
    _steps(second, 2)
    _save(second, out / "C", 2)
    if rank == 0:  # E: A with rank 1's shard file taken from B
        shutil.copytree(out / "A", out / "E")
        folder_a = next(p for p in (out / "E").iterdir() if p.is_dir())
        folder_b = next(p for p in (out / "B").iterdir() if p.is_dir())
        shutil.copy(folder_b / "__1_0.distcp", folder_a / "__1_0.distcp")
    dist.barrier()
    result = {
        "mixed": _try_load(_build(rank, world_size, 11), out / ("A" if rank == 0 else "C")),
        "swapped": _try_load(_build(rank, world_size, 11), out / "E"),
        "whole": _try_load(_build(rank, world_size, 11), out / "A"),
    }
    secure = _build(rank, world_size, None)  # secure noise: never rewound
    _steps(secure, 3)
    _save(secure, out / "S2", 2)  # saved at "step 2" but its noise has drawn 3 calls
    _steps(secure, 1)
    result["rewound"] = _try_load(secure, out / "S2")
    return result


def main(argv: list[str]) -> int:
    from opake.dpsgd.distributed import init_distributed

    out = Path(argv[1])
    torch.set_num_threads(1)
    with init_distributed(backend="gloo", timeout=60.0) as ctx:
        try:
            found = tamper(ctx.rank, ctx.world_size, out)
            torch.save(found, out / f"tamper.rank{ctx.rank}.pt")
        except Exception:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
