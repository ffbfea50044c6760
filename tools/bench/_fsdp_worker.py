"""One rank of ``fsdp_sharded.py``: build the Llama, shard it, time the steps, measure memory.

Started like ``torchrun`` would start it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; none for
one process). Writes ``rank<r>.json`` into the folder it is given. Methods:

- ``nonprivate``: ``loss.backward()`` + AdamW on the ``fully_shard``-ed model (FSDP2 as is);
  with one process the plain model (no FSDP).
- ``level1``: ``gather_full_params`` + ``clipped_grad(engine="bookkeeping")`` on
  ``compute_template(model)``, then ``ShardedDPOptimizer`` (AdamW).
- ``level2``: ``sharded_clipped_grad`` on the sharded model itself + ``ShardedDPOptimizer``;
  one physical batch per step, so ``grad_fn(..., reduce_scatter=True)``: each clipped sum is
  reduce-scattered as soon as it is formed (the ``update`` phase only adds the noise rows).
- ``dp``: one process, unsharded: ``clipped_grad(engine="bookkeeping")`` + ``DPOptimizer``.

Memory: the kernel's peak resident set (``VmHWM``) of the process, once after the setup (the
full model is built on every rank before ``fully_shard``) and for each phase of every step:
``compute`` (gradients or clipped sums, accumulated) and ``update`` (the optimizer step: for DP,
the reduce-scatter, the noise and AdamW). Before each, ``malloc_trim`` returns freed memory to
the system and writing ``5`` to ``/proc/self/clear_refs`` resets the high-water mark.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CLIP, SIGMA, LR = 1.0, 1.0, 1e-4
GIB = float(1 << 30)
Step = Callable[[], dict[str, float]]


def _status_kib(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return float(line.split()[1])
    except OSError:
        return None
    return None


def peak_rss_gib() -> float:
    """The process's peak resident set since the last reset (``VmHWM``; ``ru_maxrss`` else)."""
    kib = _status_kib("VmHWM")
    if kib is None:
        import resource

        kib = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return kib * 1024 / GIB


def rss_gib() -> float:
    """The process's resident set now (``VmRSS``; 0 where the kernel does not report it)."""
    return (_status_kib("VmRSS") or 0.0) * 1024 / GIB


def reset_peak() -> bool:
    """Return freed heap to the system and restart the peak RSS count (Linux ≥ 4.0)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class Phases:
    """Peak RSS per phase of a step: ``compute`` (the gradients or clipped sums) and ``update``
    (everything after: the optimizer step, with the DP reduce-scatter and noise)."""

    def __init__(self) -> None:
        self.peaks = {"compute": 0.0, "update": 0.0}

    def start(self) -> None:
        reset_peak()

    def end(self, phase: str) -> None:
        self.peaks[phase] = max(self.peaks[phase], peak_rss_gib())
        reset_peak()


PHASES = Phases()


def nbytes(tensors: Any) -> int:
    """Bytes held on this rank by the tensors (a ``DTensor``: its local shard)."""
    import torch
    from torch.distributed.tensor import DTensor

    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if isinstance(local, torch.Tensor):
            total += local.numel() * local.element_size()
    return total


def build(args: Any) -> torch.nn.Module:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, args.hidden // 128)
    mlp = -(-args.hidden * 8 // 3 // 256) * 256
    options: dict[str, Any] = {
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "intermediate_size": mlp,
        "vocab_size": args.vocab,
        "max_position_embeddings": args.seq,
        "attn_implementation": "eager",
    }
    torch.manual_seed(0)  # identical initial weights on every rank
    model = LlamaForCausalLM(LlamaConfig(**options))
    model.train()
    return model


def shard(model: torch.nn.Module, world_size: int) -> None:
    """Every decoder layer, the head alone, then the root (embedding, final norm)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    inner: Any = model
    for layer in inner.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(inner.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _losses(run: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    from opake.dpsgd.bookkeeping import causal_lm_losses

    def losses(*args: Any) -> torch.Tensor:
        ids = args[-1]
        return causal_lm_losses(run(*args[:-1], input_ids=ids, use_cache=False).logits, ids)

    return losses


def _dp_options(args: Any, world_size: int) -> dict[str, Any]:
    return {
        "noise_multiplier": SIGMA,
        "expected_batch_size": float(args.batch * world_size),
        "seed": 0,
    }


def nonprivate(model: torch.nn.Module, ids: torch.Tensor, args: Any) -> Step:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step() -> dict[str, float]:
        PHASES.start()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        grads = nbytes(p.grad for p in model.parameters())
        PHASES.end("compute")
        opt.step()
        opt.zero_grad(set_to_none=True)
        PHASES.end("update")
        return {"grads_or_sums": grads, "gathered": 0, "state": _state(opt)}

    return step


def _state(opt: torch.optim.Optimizer) -> int:
    return nbytes(v for s in opt.state.values() for v in s.values())


def level1(model: torch.nn.Module, ids: torch.Tensor, args: Any, world_size: int) -> Step:
    import torch

    from opake.dpsgd.bookkeeping import BatchedLoss
    from opake.dpsgd.clipping import clipped_grad
    from opake.dpsgd.distributed import ShardedDPOptimizer, compute_template, gather_full_params
    from opake.functional import make_functional

    fmodel, _ = make_functional(compute_template(model))
    shard(model, world_size)
    opt = ShardedDPOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR), model, **_dp_options(args, world_size)
    )
    grad_fn, box = clipped_grad(
        BatchedLoss(_losses(fmodel), fmodel),
        clipping_norm=CLIP,
        batch_argnums=1,
        microbatch_size=args.microbatch,
        engine="bookkeeping",
    )
    state = [box]

    def step() -> dict[str, float]:
        PHASES.start()
        full = gather_full_params(model)
        gathered = nbytes(full.values())
        grads, state[0] = grad_fn(full, ids, state=state[0])
        del full  # the gathered parameters are transient: freed before the optimizer step
        sums = nbytes(grads.values())
        opt.accumulate(grads)
        del grads
        PHASES.end("compute")
        opt.step()
        PHASES.end("update")
        return {"grads_or_sums": sums, "gathered": gathered, "state": _state(opt.optimizer)}

    return step


def level2(model: torch.nn.Module, ids: torch.Tensor, args: Any, world_size: int) -> Step:
    import torch

    from opake.dpsgd.distributed import ShardedDPOptimizer, sharded_clipped_grad

    shard(model, world_size)
    opt = ShardedDPOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR), model, **_dp_options(args, world_size)
    )
    grad_fn, box = sharded_clipped_grad(
        _losses(model), model, clipping_norm=CLIP, microbatch_size=args.microbatch
    )
    state = [box]

    def step() -> dict[str, float]:
        PHASES.start()
        # the step's only physical batch: each sum reduce-scattered as soon as it is formed
        grads, state[0] = grad_fn(ids, state=state[0], reduce_scatter=True)
        sums = nbytes(grads.values())  # this rank's rows
        opt.accumulate(grads)
        del grads
        PHASES.end("compute")
        opt.step()
        PHASES.end("update")
        return {"grads_or_sums": sums, "gathered": 0, "state": _state(opt.optimizer)}

    return step


def unsharded_dp(model: torch.nn.Module, ids: torch.Tensor, args: Any) -> Step:
    import torch

    from opake.dpsgd.bookkeeping import BatchedLoss
    from opake.dpsgd.clipping import clipped_grad
    from opake.dpsgd.optimizer import DPOptimizer
    from opake.functional import make_functional

    fmodel, params = make_functional(model)
    opt = DPOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), model, **_dp_options(args, 1))
    grad_fn, box = clipped_grad(
        BatchedLoss(_losses(fmodel), fmodel),
        clipping_norm=CLIP,
        batch_argnums=1,
        microbatch_size=args.microbatch,
        engine="bookkeeping",
    )
    state = [box]

    def step() -> dict[str, float]:
        PHASES.start()
        grads, state[0] = grad_fn(params, ids, state=state[0])
        sums = nbytes(grads.values())
        opt.accumulate(grads)
        del grads
        PHASES.end("compute")
        opt.step()
        PHASES.end("update")
        return {"grads_or_sums": sums, "gathered": 0, "state": _state(opt.optimizer)}

    return step


def prepare(args: Any, rank: int, world_size: int) -> tuple[torch.nn.Module, Step]:
    import torch

    model = build(args)
    gen = torch.Generator().manual_seed(1 + rank)  # this rank's own examples
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    if args.method == "nonprivate":
        if world_size > 1:
            shard(model, world_size)
        return model, nonprivate(model, ids, args)
    if args.method == "dp":
        return model, unsharded_dp(model, ids, args)
    make = level1 if args.method == "level1" else level2
    return model, make(model, ids, args, world_size)


def measure(args: Any, rank: int, world_size: int) -> dict[str, Any]:
    """Setup, warm-up and timed steps of one method on this rank; its figures."""
    model, step = prepare(args, rank, world_size)
    setup_peak = peak_rss_gib()
    reset = reset_peak()
    rest = rss_gib()
    walls, cpus, held = [], [], {}
    for i in range(args.warmup + args.steps):
        wall, cpu = time.perf_counter(), time.process_time()
        held = step()
        if i >= args.warmup:
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    return {
        "rank": rank,
        "params_total": sum(p.numel() for p in model.parameters()),
        "params_bytes": nbytes(model.parameters()),
        **{f"{k}_bytes": v for k, v in held.items()},
        "setup_peak_gib": setup_peak,
        "rest_gib": rest,
        "step_peak_gib": max(PHASES.peaks.values()),
        "compute_peak_gib": PHASES.peaks["compute"],
        "update_peak_gib": PHASES.peaks["update"],
        "peak_was_reset": reset,
        "wall_sec": walls,
        "cpu_sec": cpus,
    }


def worker(args: Any, out: Path) -> None:
    """The entry point of one rank process."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(args.threads)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        result = measure(args, 0, 1)
        (out / "rank0.json").write_text(json.dumps(result))
        return
    from opake.dpsgd.distributed import init_distributed

    with init_distributed(backend="gloo", timeout=args.timeout) as ctx:
        result = measure(args, ctx.rank, ctx.world_size)
        (out / f"rank{ctx.rank}.json").write_text(json.dumps(result))
        ctx.barrier()
