"""One rank of test_training_sharded.py: ``DPTraining(..., shard=True)`` (FSDP2 level 2).

``RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python _training_sharded_worker.py OUTDIR``.
The tiny Llama-like model and its FSDP units are ``_sharded_worker.py``'s.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch


def _model_module() -> Any:
    path = Path(__file__).with_name("_sharded_worker.py")
    spec = importlib.util.spec_from_file_location("opake_test_sharded_worker", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


W = _model_module()
SEED = 7
STEPS = 3


def build(world_size: int, **options: Any) -> tuple[torch.nn.Module, Any]:
    """The sharded model and its ``DPTraining(shard=True)`` (seeded, SGD)."""
    from opake.dpsgd.training import DPTraining

    model = W.make_model()
    W.shard(model, world_size)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    training = DPTraining(
        W.losses_of(model),
        torch.optim.SGD(params.values(), lr=W.LR),
        params,
        module=model,
        dataset_size=W.N,
        sample_rate=W.Q,
        noise_multiplier=W.SIGMA,
        delta=1e-5,
        clipping_norm=W.CLIP,
        accountant="rdp",
        microbatch_size=2,
        seed=SEED,
        shard=True,
        **options,
    )
    return model, training


def _parts(ids: torch.Tensor, idx: list[int]) -> list[torch.Tensor]:
    return [ids[torch.tensor(part, dtype=torch.long)] for part in W._halves(idx)]


def run(training: Any, steps: int) -> list[int]:
    """``steps`` logical steps, each from 2 physical batches (every rank: 2 calls)."""
    ids = W.data()
    sizes = []
    for _, idx in zip(range(steps), training.batches(), strict=False):
        sizes.append(len(idx))
        parts = [ids[torch.tensor(part, dtype=torch.long)] for part in W._halves(idx)]
        training.logical_step([(part,) for part in parts])
    return sizes


def whole_steps(world_size: int, steps: int) -> dict[str, Any]:
    """``steps`` steps by ``DPTraining.step`` (one physical batch each, so each parameter's sum
    is reduce-scattered as it is formed) next to the same steps by ``logical_step`` (two
    physical batches, reduced in the optimizer's step): the parameters of both and the kind of
    sums the optimizer received."""
    from opake.dpsgd.distributed import ShardedDPOptimizer

    received: list[str] = []
    inner = ShardedDPOptimizer.accumulate

    def spy(self: Any, grads: Any) -> Any:
        received.append(type(grads).__name__)
        return inner(self, grads)

    ShardedDPOptimizer.accumulate = spy  # type: ignore[method-assign]
    try:
        halves_model, halves = build(world_size)
        run(halves, steps)
        split = len(received)
        whole_model, whole = build(world_size)
        ids = W.data()
        for _, idx in zip(range(steps), whole.batches(), strict=False):
            whole.step(ids[torch.tensor(idx, dtype=torch.long)])
        end = len(received)
        # one DPTraining, every way of ending a step: step() after logical_step() and after a
        # dropped accumulate() still reduce-scatters in the call (a new step each time)
        _, mixed = build(world_size)
        indices = mixed.batches()
        mixed.logical_step([(part,) for part in _parts(ids, next(indices))])
        mixed.step(ids[torch.tensor(next(indices), dtype=torch.long)])
        mixed.accumulate(ids[torch.tensor(next(indices), dtype=torch.long)])
        mixed.zero_grad()
        mixed.step(ids[torch.tensor(next(indices), dtype=torch.long)])
    finally:
        ShardedDPOptimizer.accumulate = inner  # type: ignore[method-assign]
    return {
        "mixed_steps": mixed.steps,
        "halves": full(halves_model),
        "whole": full(whole_model),
        "received_halves": received[:split],
        "received_whole": received[split:end],
        "received_mixed": received[end:],
    }


def full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from opake.dpsgd.distributed import gather_full_params

    return {n: t.clone() for n, t in gather_full_params(model).items()}


def refusals(world_size: int) -> dict[str, str]:
    """What needs a process group to be refused: an unsharded model; a sharded state dict."""
    from opake.core.errors import ConfigurationError, OperationError
    from opake.dpsgd.training import DPTraining

    out: dict[str, str] = {}
    plain = W.make_model()
    params = dict(plain.named_parameters())
    try:
        DPTraining(
            W.losses_of(plain),
            torch.optim.SGD(params.values(), lr=0.1),
            params,
            module=plain,
            dataset_size=W.N,
            sample_rate=W.Q,
            noise_multiplier=1.0,
            delta=1e-5,
            shard=True,
        )
    except ConfigurationError as err:
        out["unsharded"] = str(err)
    _, training = build(world_size)
    try:
        training.state_dict()
    except OperationError as err:
        out["state_dict"] = str(err)
    return out


def main(argv: list[str]) -> int:
    from opake.dpsgd.distributed import init_distributed

    out = Path(argv[0])
    torch.set_num_threads(1)
    with init_distributed(backend="gloo", timeout=60.0) as ctx:
        try:
            rank, world_size = ctx.rank, ctx.world_size
            model, training = build(world_size)
            sizes = run(training, STEPS - 1)
            training.save(out / "ckpt")
            sizes += run(training, 1)
            record: dict[str, Any] = {
                "sizes": sizes,
                "params": full(model),
                "epsilon": training.epsilon(),
                "steps": training.steps,
                "engine": training.grad_fn.engine,
                "repr": repr(training),
            }
            resumed_model, resumed = build(world_size)
            resumed.load(out / "ckpt")
            record["resumed_steps_before"] = resumed.steps
            run(resumed, 1)
            record["resumed"] = full(resumed_model)
            record["resumed_epsilon"] = resumed.epsilon()
            record["refusals"] = refusals(world_size)
            record["whole_steps"] = whole_steps(world_size, 2)
            torch.save(record, out / f"rank{rank}.pt")
        except Exception:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)  # do not wait in destroy_process_group for a rank that is gone
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's finalization (a gloo thread can abort it)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
