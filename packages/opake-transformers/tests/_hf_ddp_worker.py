"""One rank of a two-process DPTrainer run (launched by test_dp_trainer_ddp.py with the
environment torchrun sets). Writes rank 0's final parameters and ε to OUT/result.pt."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch


def main(out: str) -> None:
    spec = importlib.util.spec_from_file_location(
        "_hf_helpers", Path(__file__).with_name("_hf_helpers.py")
    )
    assert spec is not None
    assert spec.loader is not None
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    from opake.transformers import DPTrainer

    torch.set_num_threads(1)
    args = helpers.dp_args(
        Path(out) / "run",
        per_device_train_batch_size=helpers.PER_DEVICE // 2,
        max_steps=2,
        ddp_backend="gloo",
    )
    assert args.world_size == 2, args.world_size
    trainer = DPTrainer(
        model=helpers.tiny_causal_lm(), args=args, train_dataset=helpers.token_data()
    )
    trainer.train()
    if args.process_index == 0:
        torch.save(
            {
                "params": helpers.params(trainer.model),
                "epsilon": trainer.dp_training.epsilon(),
                "world_size": trainer.dp_training.world_size,
            },
            Path(out) / "result.pt",
        )
    # The Trainer leaves its process group up. Rank 0 hosts the rendezvous store: if it exits
    # while rank 1 still tears its group down at interpreter exit, rank 1 aborts in gloo's
    # threads ("terminate called without an active exception"). Leave together.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    # ... and skip the interpreter's finalization, where the same abort can still happen
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
