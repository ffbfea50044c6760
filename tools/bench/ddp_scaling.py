"""Data-parallel scaling of one DP-SGD step: 1 vs 2 processes on CPU (gloo).

Workload (the tiny Llama of tools/bench/dpsgd_step.py): a Llama built from a config (hidden
256, 4 layers, 4 heads, intermediate 688, vocab 4096, eager attention, no download), a fixed
global batch of 32 sequences × 64 random tokens, full fine-tuning, SGD. Each rank takes rows
``rank::world_size`` of the global batch, runs ``clipped_grad`` (per-example ``vmap``, clip,
fp32 sum; ``--microbatch-size``) and ``DistributedDPOptimizer.step`` (all-reduce of the clipped
sums, Gaussian noise once, update). ``--small`` shrinks it (hidden 128, 2 layers, vocab 1024,
batch 16, seq 32) for a quick look.

Configurations, each in fresh processes started like ``torchrun`` would (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT): ``PxT`` = P processes × T torch threads each — ``1x1`` (baseline),
``2x1`` (data parallel), ``1x2`` (the same two cores used as intra-op threads instead).
Per step, every rank's ``opake.profiling.step_perf`` figures are all-gathered with
``opake.dpsgd.distributed.gather_metrics``; the step time of a synchronous step is the slowest
rank's. Reported: medians over ``--steps`` timed steps after ``--warmup``, the time split
(``clip`` = per-example gradients; ``sync`` = all-reduce + noise + update), CPU time per rank,
peak RSS per rank, and

    scaling efficiency     = T(1x1) / (2 · T(2x1))          (wall clock; 1.0 = linear scaling)
    CPU-work efficiency    = CPU(1x1) / Σ_ranks CPU(2x1)    (1.0 = no extra work for 2 ranks)

The second figure is robust to other processes sharing the cores (it counts the work done, not
the time waited); the first is what a user sees, and is only meaningful on an otherwise idle
machine. Both are printed with the load average measured before the run.

    python tools/bench/ddp_scaling.py                     # 1x1, 2x1, 1x2 on the full workload
    python tools/bench/ddp_scaling.py --small --steps 5
    python tools/bench/ddp_scaling.py --configs 1x1 2x1 --json ddp.json

Results are recorded in docs/benchmarks.md ("Distributed scaling (DDP)").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FULL: dict[str, Any] = {
    "config": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 688,
        "vocab_size": 4096,
    },
    "batch": 32,
    "seq": 64,
}
SMALL: dict[str, Any] = {
    "config": {
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 344,
        "vocab_size": 1024,
    },
    "batch": 16,
    "seq": 32,
}
CLIP, SIGMA, LR = 1.0, 1.0, 1e-3


def _worker(args: argparse.Namespace) -> None:
    """One rank: build, warm up, time ``--steps`` steps; rank 0 prints the gathered figures."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from opake.dpsgd.clipping import clipped_grad
    from opake.dpsgd.distributed import DistributedDPOptimizer, gather_metrics, init_distributed
    from opake.functional import make_functional
    from opake.profiling import step_perf

    torch.set_num_threads(args.threads)
    workload = SMALL if args.small else FULL
    ctx = init_distributed(backend="gloo", timeout=600)
    torch.manual_seed(0)
    options: dict[str, Any] = {
        **workload["config"],
        "max_position_embeddings": workload["seq"],
        "attn_implementation": "eager",
    }
    cfg = LlamaConfig(**options)
    model = LlamaForCausalLM(cfg)
    model.train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (workload["batch"], workload["seq"]), generator=gen)
    local = ids[ctx.rank :: ctx.world_size]
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)

    def loss_fn(trainable: Any, frozen: Any, input_ids: Any, labels: Any) -> Any:
        out = fmodel(
            (trainable, frozen), input_ids=input_ids[None], labels=labels[None], use_cache=False
        )
        return out.loss

    grad_fn, state = clipped_grad(
        loss_fn,
        clipping_norm=CLIP,
        batch_argnums=(2, 3),
        microbatch_size=args.microbatch_size,
        check_unused=False,
    )
    opt = DistributedDPOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        model,
        noise_multiplier=SIGMA,
        expected_batch_size=float(workload["batch"]),
        seed=0,
        check_sync_every=0,
    )
    rows = []
    for i in range(args.warmup + args.steps):
        cpu0 = time.process_time()
        with step_perf("cpu", batch_size=len(local)) as perf:
            grads, state = grad_fn(trainable, frozen, local, local, state=state)
            perf.mark("clip")
            opt.accumulate(grads)
            opt.step()
            perf.mark("sync")
        figures = perf.result.to_dict()
        figures["cpu_sec"] = time.process_time() - cpu0
        gathered = gather_metrics(figures)
        if i >= args.warmup:
            rows.append(gathered.per_rank)
    if ctx.rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(json.dumps({"params": params, "steps": rows}))
    ctx.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run(config: str, args: argparse.Namespace) -> dict[str, Any]:
    procs_n, threads = (int(v) for v in config.split("x"))
    port = _free_port()
    cmd = [sys.executable, __file__, "--worker", "--threads", str(threads)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.microbatch_size:
        cmd += ["--microbatch-size", str(args.microbatch_size)]
    if args.small:
        cmd.append("--small")
    procs = []
    for rank in range(procs_n):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(procs_n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS=str(threads),
            TOKENIZERS_PARALLELISM="false",
            HF_HUB_OFFLINE="1",
        )
        pipe = subprocess.PIPE
        procs.append(subprocess.Popen(cmd, env=env, stdout=pipe, stderr=pipe, text=True))
    outs = [p.communicate() for p in procs]
    for rank, (proc, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        if proc.returncode != 0:
            raise SystemExit(f"{config}: rank {rank} failed:\n{err[-3000:]}")
    data = json.loads(outs[0][0].strip().splitlines()[-1])
    steps = data["steps"]

    def median_max(key: str) -> float:
        return float(statistics.median(max(rank.get(key, 0.0) for rank in step) for step in steps))

    return {
        "config": config,
        "processes": procs_n,
        "threads": threads,
        "params": data["params"],
        "step_sec": median_max("step_time_sec"),
        "clip_sec": median_max("marks/clip_sec"),
        "sync_sec": median_max("marks/sync_sec"),
        "cpu_sec_per_rank": [
            statistics.median(step[r]["cpu_sec"] for step in steps) for r in range(procs_n)
        ],
        "peak_rss_gb_per_rank": [
            max(step[r].get("memory_peak_gb", 0.0) for step in steps) for r in range(procs_n)
        ],
        "imbalance": statistics.median(
            max(r["step_time_sec"] for r in step)
            / statistics.mean(r["step_time_sec"] for r in step)
            for step in steps
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["1x1", "2x1", "1x2"])
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median; ≥ 3)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--microbatch-size", type=int, default=8)
    parser.add_argument("--small", action="store_true", help="the reduced workload")
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    if args.steps < 3:
        parser.error("--steps must be at least 3")
    for config in args.configs:
        parts = config.split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            parser.error(f"config {config!r}: expected PxT, e.g. 2x1")
    load = os.getloadavg()
    results = []
    for config in args.configs:
        result = _run(config, args)
        results.append(result)
        print(json.dumps(result), file=sys.stderr)
    workload = SMALL if args.small else FULL
    base = next((r for r in results if r["config"] == "1x1"), None)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}")
    print(f"load average before the run: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    print(
        f"workload: Llama {workload['config']}, global batch {workload['batch']} × seq "
        f"{workload['seq']}, microbatch {args.microbatch_size}, {args.steps} timed steps "
        f"after {args.warmup} warm-up"
    )
    print()
    print(
        "| config | s/step (slowest rank) | clip s | all-reduce+noise+update s | "
        "examples/s | speed-up vs 1x1 | scaling efficiency | CPU s/step per rank | "
        "CPU-work efficiency | peak RSS GiB per rank |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        speedup = base["step_sec"] / r["step_sec"] if base else float("nan")
        efficiency = speedup / r["processes"] if base else float("nan")
        cpu_eff = (
            sum(base["cpu_sec_per_rank"]) / sum(r["cpu_sec_per_rank"]) if base else float("nan")
        )
        print(
            f"| {r['config']} | {r['step_sec']:.3f} | {r['clip_sec']:.3f} | "
            f"{r['sync_sec']:.3f} | {workload['batch'] / r['step_sec']:.1f} | {speedup:.2f} | "
            f"{efficiency:.2f} | {', '.join(f'{c:.2f}' for c in r['cpu_sec_per_rank'])} | "
            f"{cpu_eff:.2f} | {', '.join(f'{m:.2f}' for m in r['peak_rss_gb_per_rank'])} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"results": results, "load": load}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
