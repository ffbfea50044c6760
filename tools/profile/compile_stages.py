"""The compiled and the eager book-keeping DP step, stage by stage, with their baselines.

    python tools/profile/compile_stages.py                        # benchmark Llama, 3 steps
    python tools/profile/compile_stages.py --model smollm2 --batch 8 --seq 128 \
        --microbatch-size 4 --steps 3

Builds the four configurations of ``tools/bench/compile_step.py --paired`` (``opake-bk``,
``opake-bk-compiled``, ``nonprivate``, ``nonprivate-compiled``: ``DPTraining`` with a
``BatchedLoss``, eager or ``compile=True``, against the plain step, eager or through
``torch.compile(model)``) in one process, runs their steps interleaved and, for the two DP
steps, times the engine's stages: the recorded forward and backward (eager, or the compiled
recording), the certified bounds (``LeafBoundsFn``: Gram matrices and bound arithmetic), the
clipped sum (``BookkeepingChunk.accumulate``) and the secure noise (``GaussianNoise.add_``).
Wall time at torch's default thread count unless ``--threads``; medians over ``--steps``
steps after the compiling step and one warm-up step.

What it answers: which part of the DP step compiling speeds up, and which part it cannot
(matrix products at the CPU's peak, the secure noise), i.e. why the compiled DP step's ratio
to its compiled baseline is what it is. Recorded in docs/benchmarks.md ("Book-keeping
compiled, bound arithmetic included").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the workload

METHODS = ("opake-bk", "opake-bk-compiled", "nonprivate", "nonprivate-compiled")
STAGES = ("forward + backward", "certified bounds", "clipped sum", "secure noise")


def _wrap(owner: Any, name: str, label: str, acc: dict[str, float]) -> None:
    """Replace the method ``owner.name`` by a timed call adding its duration to ``acc``."""
    fn = owner.__dict__[name]

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[label] += time.perf_counter() - start

    setattr(owner, name, timed)


def _instrument(acc: dict[str, float]) -> None:
    from opake.dpsgd.bookkeeping import _chunk, _compiled, _fused, _runner
    from opake.dpsgd.noise import GaussianNoise

    _wrap(_runner.BookkeepingRunner, "_forward_backward", "forward + backward", acc)
    _wrap(_compiled.CompiledRecording, "forward_backward", "forward + backward", acc)
    _wrap(_fused.LeafBoundsFn, "__call__", "certified bounds", acc)
    _wrap(_chunk.BookkeepingChunk, "accumulate", "clipped sum", acc)
    _wrap(GaussianNoise, "add_", "secure noise", acc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="smollm2, a .gguf file or an HF directory")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--microbatch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)

    import compile_step
    import torch
    from _dpsgd_workload import build

    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.model or "benchmark Llama"  # (the workload resolves args.model to a path)
    work = compile_step._workload(args)
    steps: dict[str, Callable[[], None]] = {}
    for method in METHODS:
        model, ids = build("full", work)
        if method.startswith("nonprivate"):
            steps[method] = compile_step._nonprivate(model, ids, method.endswith("compiled"))
        else:
            steps[method] = compile_step._private(model, ids, method, args, work)
        for _ in range(2):  # the compiling step, one warm-up step
            steps[method]()
    acc: dict[str, float] = defaultdict(float)
    _instrument(acc)
    totals: dict[str, list[float]] = defaultdict(list)
    stages: dict[tuple[str, str], list[float]] = defaultdict(list)
    for _ in range(args.steps):
        for method, step in steps.items():
            acc.clear()
            start = time.perf_counter()
            step()
            totals[method].append(time.perf_counter() - start)
            for stage in STAGES if method.startswith("opake") else ():
                stages[method, stage].append(acc[stage])
    threads = torch.get_num_threads()
    print(
        f"{name}, full fine-tuning, batch {work.batch} × {work.seq}, chunks of "
        f"{args.microbatch_size}, {threads} threads, median of {args.steps} interleaved steps"
    )
    print(f"| stage (ms) | {' | '.join(METHODS)} |")
    print(f"|---|{'---:|' * len(METHODS)}")
    for label in ("step", *STAGES):
        cells = []
        for method in METHODS:
            values = totals[method] if label == "step" else stages.get((method, label))
            cells.append(f"{1e3 * statistics.median(values):,.0f}" if values else "")
        print(f"| {label} | {' | '.join(cells)} |")
    eager = statistics.median(totals["opake-bk"]) / statistics.median(totals["nonprivate"])
    compiled = statistics.median(totals["opake-bk-compiled"]) / statistics.median(
        totals["nonprivate-compiled"]
    )
    print(f"DP / its baseline: eager {eager:.3f}×, compiled {compiled:.3f}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
