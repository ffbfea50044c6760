"""DP-SGD under FSDP2: per-rank memory and step time of level 2 vs level 1 vs non-private.

Workload: a Llama built from a config (``LlamaForCausalLM``, fp32, eager attention, no
download; hidden 1024, 16 layers, vocab 32000 by default: about 270 M parameters, whose AdamW
training state, 16 bytes a parameter, is about 4.3 GB in one process), full fine-tuning with
AdamW, a fixed batch of ``--batch`` random sequences of ``--seq`` tokens **per rank**, one
physical batch per step. Each decoder layer, the head and the root are ``fully_shard``-ed over a
1-D gloo CPU mesh. Methods (``docs/design/fsdp2.md``):

- ``nonprivate``: FSDP2 as is, ``loss.backward()`` + AdamW (with one process: the plain model);
- ``level1``: ``ShardedDPOptimizer`` + ``gather_full_params`` + ``clipped_grad`` (book-keeping
  engine) on ``compute_template(model)``: the whole model gathered every step;
- ``level2``: ``sharded_clipped_grad`` + ``ShardedDPOptimizer``: FSDP gathers one unit at a time,
  and each clipped sum is reduce-scattered as soon as it is formed (``reduce_scatter=True``);
- with one process, both DP levels are the unsharded ``clipped_grad`` (book-keeping) +
  ``DPOptimizer`` (one row, ``DP (unsharded)``).

World sizes 1, 2 and 4 by default, each run in fresh processes started like ``torchrun`` would
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), one torch thread each. Reported per run:

- **peak RSS per rank** (GiB, the kernel's ``VmHWM``) of the training steps — the high-water mark
  is reset after the setup (model built, sharded, freed memory trimmed) — split into the
  ``compute`` phase (gradients or clipped sums) and the ``update`` phase (optimizer step; for
  DP: reduce-scatter, noise, AdamW), the largest rank's; and of the setup (every rank builds
  the full model before ``fully_shard``; meta-device initialisation, not used here, would
  avoid it);
- the **bytes held per rank** after a step: parameters (local shards), optimizer state (local
  shards), gradients (non-private: FSDP's gradient shards) or the fp32 clipped sums (DP:
  full size, or this rank's rows at level 2), and the parameters gathered by level 1;
- **step time**: median over ``--steps`` timed steps after ``--warmup``, wall clock of the
  slowest rank and CPU seconds per rank.

``--cap-gib X`` is a per-process memory cap checked, not enforced: a run whose peak resident set
(setup or steps, any rank) exceeds X GiB is reported ``exceeds cap``. Resident memory is what
the kernel's OOM killer and cgroup limits act on; ``RLIMIT_AS`` would count virtual reservations
(allocator arenas, thread stacks, the CUDA-less torch libraries), which do not use memory.

    python tools/bench/fsdp_sharded.py --quick                  # tiny model, seconds
    python tools/bench/fsdp_sharded.py --layers 8 --cap-gib 3 --json fsdp.json
    python tools/bench/fsdp_sharded.py --world-sizes 2 4 --methods level1 level2
    python tools/bench/fsdp_sharded.py --table-from fsdp.json --cap-gib 4   # another cap

On a shared machine the times are loaded (the load average is printed); the memory figures are
what this benchmark is for.
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
import tempfile
from pathlib import Path
from typing import Any

METHODS = ("nonprivate", "level1", "level2")
LABELS = {
    "nonprivate": "non-private FSDP2",
    "level1": "level 1 (gather + clipped_grad)",
    "level2": "level 2 (sharded_clipped_grad)",
    "dp": "DP (unsharded)",
}
GIB = float(1 << 30)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker_args(args: argparse.Namespace, method: str) -> list[str]:
    cmd = [sys.executable, __file__, "--worker", "--method", method]
    for name in ("layers", "hidden", "vocab", "batch", "seq", "microbatch", "steps", "warmup"):
        cmd += [f"--{name}", str(getattr(args, name))]
    return [*cmd, "--timeout", str(args.timeout)]


def run(method: str, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """One method at one world size, in fresh processes; the ranks' figures, aggregated."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(world_size):
            env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
            for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                env.pop(name, None)
            if world_size > 1:
                env.update(
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(world_size),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                )
            cmd = [*_worker_args(args, method), "--out", tmp]
            pipe = subprocess.PIPE
            procs.append(subprocess.Popen(cmd, env=env, stdout=pipe, stderr=pipe, text=True))
        errors = []
        for rank, proc in enumerate(procs):
            _, err = proc.communicate(timeout=args.timeout)
            if proc.returncode != 0:
                errors.append(f"rank {rank} exited {proc.returncode}:\n{err[-3000:]}")
        if errors:
            return {"method": method, "world_size": world_size, "error": "\n".join(errors)}
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world_size)]
    return aggregate(method, world_size, ranks, args.cap_gib)


def aggregate(
    method: str, world_size: int, ranks: list[dict[str, Any]], cap: float | None
) -> dict[str, Any]:
    steps = len(ranks[0]["wall_sec"])
    slowest = [max(r["wall_sec"][i] for r in ranks) for i in range(steps)]
    result: dict[str, Any] = {
        "method": method,
        "world_size": world_size,
        "params": ranks[0]["params_total"],
        "step_peak_gib_per_rank": [round(r["step_peak_gib"], 3) for r in ranks],
        "setup_peak_gib_per_rank": [round(r["setup_peak_gib"], 3) for r in ranks],
        "rss_after_setup_gib_per_rank": [round(r["rest_gib"], 3) for r in ranks],
        "compute_peak_gib": max(r["compute_peak_gib"] for r in ranks),
        "update_peak_gib": max(r["update_peak_gib"] for r in ranks),
        "peak_reset": all(r["peak_was_reset"] for r in ranks),
        "step_sec": statistics.median(slowest),
        "cpu_sec_per_rank": [round(statistics.median(r["cpu_sec"]), 3) for r in ranks],
    }
    for key in ("params", "state", "grads_or_sums", "gathered"):
        result[f"{key}_gib_rank0"] = ranks[0][f"{key}_bytes"] / GIB
    if cap is not None:
        result["within_cap"] = within(result, cap)
    return result


def within(result: dict[str, Any], cap: float) -> bool:
    """Whether every rank's peak RSS (setup and steps) stays within ``cap`` GiB."""
    peaks: list[float] = result["step_peak_gib_per_rank"] + result["setup_peak_gib_per_rank"]
    return max(peaks) <= cap


def _gib(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def table(results: list[dict[str, Any]], cap: float | None) -> list[str]:
    head = (
        "| ranks | method | peak RSS GiB per rank (steps) | compute / update peak GiB | "
        "RSS after setup GiB | setup peak GiB | params GiB/rank | "
        "AdamW state GiB/rank | grads or clipped sums GiB/rank | gathered GiB/rank | "
        "s/step (slowest rank) | CPU s/step per rank |"
    )
    lines = [head + (" cap |" if cap is not None else ""), "|---|---|" + "---:|" * 10]
    if cap is not None:
        lines[1] += "---|"
    for r in results:
        name = LABELS[r["method"]]
        if "error" in r:
            first = r["error"].strip().splitlines()[-1][:120]
            lines.append(f"| {r['world_size']} | {name} | failed: {first} |")
            continue
        row = (
            f"| {r['world_size']} | {name} | {_gib(r['step_peak_gib_per_rank'])} | "
            f"{r['compute_peak_gib']:.2f} / {r['update_peak_gib']:.2f} | "
            f"{max(r['rss_after_setup_gib_per_rank']):.2f} | "
            f"{max(r['setup_peak_gib_per_rank']):.2f} | {r['params_gib_rank0']:.3f} | "
            f"{r['state_gib_rank0']:.3f} | {r['grads_or_sums_gib_rank0']:.3f} | "
            f"{r['gathered_gib_rank0']:.3f} | {r['step_sec']:.2f} | "
            f"{_gib(r['cpu_sec_per_rank'])} |"
        )
        if cap is not None:
            row += " fits |" if r["within_cap"] else " **exceeds cap** |"
        lines.append(row)
    return lines


def plan(args: argparse.Namespace) -> list[tuple[str, int]]:
    runs: list[tuple[str, int]] = []
    for world_size in args.world_sizes:
        for name in args.methods:
            # unsharded, level 1 and level 2 are the same computation
            method = "dp" if world_size == 1 and name != "nonprivate" else name
            if (method, world_size) not in runs:
                runs.append((method, world_size))
    return runs


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--microbatch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--cap-gib", type=float, help="per-process cap on peak RSS (checked)")
    parser.add_argument("--quick", action="store_true", help="a tiny model (2 layers, hidden 64)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--table-from", type=Path, help="print the table of a --json file (with --cap-gib); no run"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", default="level2", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.vocab, args.seq, args.steps = 2, 64, 512, 16, 2
    if args.steps < 1 or args.warmup < 0 or min(args.world_sizes) < 1:
        parser.error("--steps ≥ 1, --warmup ≥ 0 and world sizes ≥ 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        from _fsdp_worker import worker

        worker(args, args.out)
        return 0
    if args.table_from:
        results = json.loads(args.table_from.read_text())["results"]
        for r in results:
            if "error" not in r and args.cap_gib is not None:
                r["within_cap"] = within(r, args.cap_gib)
        print("\n".join(table(results, args.cap_gib)))
        return 0
    load = os.getloadavg()
    results = []
    for method, world_size in plan(args):
        result = run(method, world_size, args)
        results.append(result)
        print(json.dumps(result), file=sys.stderr)
    params = next((r["params"] for r in results if "params" in r), 0)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}")
    print(f"load average before the run: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    print(
        f"workload: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab} "
        f"({params / 1e6:.0f} M parameters, fp32, AdamW), {args.batch} × {args.seq} tokens per "
        f"rank and step, microbatch {args.microbatch}; {args.steps} timed steps after "
        f"{args.warmup} warm-up; gloo, CPU, 1 thread per rank"
        + (f"; cap {args.cap_gib:g} GiB of peak RSS per process" if args.cap_gib else "")
    )
    print()
    print("\n".join(table(results, args.cap_gib)))
    if args.json:
        args.json.write_text(json.dumps({"results": results, "load": load}, indent=2))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
