"""Secure noise generation as a fraction of one DP-SGD step (the DP-step benchmark model).

The model and batch are those of ``tools/bench/dpsgd_step.py`` (Llama from a config, hidden 256,
4 layers, vocabulary 4096, 5,261,568 trainable parameters; batch 32 × 64 tokens). In one
process, with one torch thread, interleaved over ``--rounds`` rounds, it times (process CPU time
and wall time, medians):

- ``secure noise``: ``GaussianNoise(σ).add(...)`` over every trainable tensor — the ChaCha20
  keystream under an OS key, Box–Muller in fp64 on the CPU, added to the fp32 sums in fp64 and
  rounded once onto the noise's lattice (``opake.dpsgd.noise.noise_grid``);
- ``torch.randn noise``: the same with ``add_noise(..., generator=torch.Generator())`` (torch's
  Mersenne Twister: the previous implementation, not cryptographic), for comparison;
- ``DP step``: one whole step of ``dpsgd_step.py``'s ``opake`` method (``--engine``: vmap or
  bookkeeping; clip, sum, noise, SGD update).

    python tools/bench/noise_generation.py --rounds 5
    python tools/bench/noise_generation.py --threads 2 --baseline OLD_TREE --draws 40

``--threads`` sets torch's thread count (default 1). Comparing this tree's noise code with an
older tree's, side by side in one process, needs the private modules of both: that is the
developer profiler ``tools/profile/noise_ab.py`` (not shipped).

Results are recorded in docs/benchmarks.md ("Secure noise generation").
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from _dpsgd_methods import opake_step
from _dpsgd_workload import build


def _timed(fn: Any) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def parser() -> argparse.ArgumentParser:
    """The command line (``tools/profile/noise_ab.py`` adds ``--baseline`` and ``--draws``)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engine", choices=("vmap", "bookkeeping"), default="bookkeeping")
    parser.add_argument("--microbatch-size", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    return parser


def main() -> None:
    measure(parser().parse_args())


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Time the noise against the DP step and print the table; the zero sums it noised (one
    fp32 tensor per trainable parameter of the benchmark model)."""
    import torch

    from opake.dpsgd.noise import GaussianNoise, add_noise

    torch.set_num_threads(args.threads)
    model, ids = build("full")
    step, _ = opake_step(model, ids, args, engine=args.engine)
    sums = {n: torch.zeros_like(p) for n, p in model.named_parameters() if p.requires_grad}
    count = sum(t.numel() for t in sums.values())
    secure = GaussianNoise(1.0)
    generator = torch.Generator().manual_seed(0)
    work = {
        "secure noise": lambda: secure.add(sums, sensitivity=1.0),
        "torch.randn noise": lambda: add_noise(
            sums, noise_multiplier=1.0, sensitivity=1.0, generator=generator
        ),
        "DP step": step,
    }
    for fn in work.values():  # warm-up
        fn()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in work}
    for _ in range(args.rounds):
        for name, fn in work.items():
            times[name].append(_timed(fn))
    med = {name: (statistics.median(c for c, _ in t), statistics.median(w for _, w in t))
           for name, t in times.items()}  # fmt: skip
    step_cpu, _step_wall = med["DP step"]
    threads = f"{args.threads} torch thread{'s' if args.threads > 1 else ''}"
    print(f"{count:,} noised values; engine {args.engine}; {args.rounds} rounds; {threads}")
    print("| what | CPU s | wall s | fraction of the DP step (CPU) |")
    print("|---|---:|---:|---:|")
    for name, (cpu, wall) in med.items():
        print(f"| {name} | {cpu:.4f} | {wall:.4f} | {cpu / step_cpu:.3f} |")
    return sums


if __name__ == "__main__":
    main()
