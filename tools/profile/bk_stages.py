"""Where one book-keeping DP step's time goes, stage by stage, on the DP-step benchmark model.

    python tools/profile/bk_stages.py                     # documented path, 1 thread, 3 steps
    python tools/profile/bk_stages.py --method opake-bk --threads 2 --steps 5
    python tools/profile/bk_stages.py --model smollm2 --batch 8 --seq 128 --threads 2

Builds the model and the step of ``tools/bench/dpsgd_step.py`` (``opake-user``: patched model,
loss-only head, ``BatchedLoss``, ``engine="auto"``; or ``opake-bk``: the stock model with its
logits) and wraps the engine's stages with a timer: the recorded forward, the backward (output
gradients only), the layers' pieces, the certified bounds (``leaf_bounds``: Gram matrices,
token norms and error bounds), the exact route where a bound is loose, the
clipped sum (``BookkeepingChunk.accumulate``, and inside it the loss-only head's implicit
piece), and the optimizer (noise + update). Times are process CPU time with one thread (wall
time otherwise), the median over ``--steps`` steps after two warm-up steps; the non-private
step of the stock model is timed in the same process, interleaved, for the ratio.

Recorded in docs/benchmarks.md ("Where the book-keeping step's time goes").
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the DP-step workload


def _wrap(owner: Any, name: str, label: str, acc: dict[str, float], clock: Any) -> None:
    """Replace ``owner.name`` by a timed call that adds its duration to ``acc[label]``."""
    raw = owner.__dict__[name]
    static = isinstance(raw, staticmethod)
    fn = raw.__func__ if static else raw

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[label] += clock() - start

    setattr(owner, name, staticmethod(timed) if static else timed)


def _instrument(acc: dict[str, float], clock: Any) -> None:
    import torch

    from opake.dpsgd.bookkeeping import _chunk, _fused, _runner
    from opake.dpsgd.optimizer import DPOptimizer

    _wrap(_runner.BookkeepingRunner, "_forward_backward", "forward + backward", acc, clock)
    _wrap(_runner.BookkeepingRunner, "_pieces", "pieces", acc, clock)
    _wrap(_fused.LeafBoundsFn, "__call__", "certified bounds", acc, clock)
    _wrap(_runner, "measure_blocks", "exact route (measure)", acc, clock)
    _wrap(_chunk.BookkeepingChunk, "accumulate", "clipped sum", acc, clock)
    _wrap(DPOptimizer, "step", "noise + update", acc, clock)
    try:
        from opake.kernels.chunked._example_grads import LinearCEExampleGrads
    except ImportError:  # no kernels distribution: the head is not implicit
        pass
    else:
        _wrap(LinearCEExampleGrads, "weighted_sum", "  of which the head's sum", acc, clock)
    backward = torch.autograd.backward

    def timed_backward(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return backward(*args, **kwargs)
        finally:
            acc["  of which backward"] += clock() - start

    torch.autograd.backward = timed_backward  # type: ignore[assignment]


ORDER = (
    "forward + backward",
    "  of which backward",
    "pieces",
    "certified bounds",
    "exact route (measure)",
    "clipped sum",
    "  of which the head's sum",
    "noise + update",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=["opake-user", "opake-bk"], default="opake-user")
    parser.add_argument("--mode", choices=["full", "lora"], default="full")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", default=None, help="smollm2, a .gguf file or an HF directory")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    args = parser.parse_args(argv)

    import torch
    from _dpsgd_methods import nonprivate_step, opake_step, opake_user_step
    from _dpsgd_workload import build, workload

    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    options = argparse.Namespace(microbatch_size=None)
    name = args.model or "benchmark Llama"
    if args.model is not None:
        from _pretrained import resolve_model

        args.model = resolve_model(args.model)
    work = workload(args)
    model, ids = build(args.mode, work)
    if args.method == "opake-user":
        step, _ = opake_user_step(model, ids, options, work, "auto")
    else:
        step, _ = opake_step(model, ids, options, work, engine="bookkeeping")
    stock, stock_ids = build(args.mode, work)
    plain, _ = nonprivate_step(stock, stock_ids)
    for _ in range(2):
        step()
        plain()
    acc: dict[str, float] = defaultdict(float)
    _instrument(acc, clock)
    stages: dict[str, list[float]] = defaultdict(list)
    totals: dict[str, list[float]] = {"DP step": [], "non-private step": []}
    runs: list[tuple[str, Callable[[], None]]] = [("DP step", step), ("non-private step", plain)]
    for _ in range(args.steps):
        for label, fn in runs:
            acc.clear()
            start = clock()
            fn()
            totals[label].append(clock() - start)
            if label == "DP step":
                for stage, value in acc.items():
                    stages[stage].append(value)
    unit = "CPU" if args.threads == 1 else "wall"
    what = f"{name}, batch {work.batch} × {work.seq}"
    median = f"{args.threads} thread(s), median of {args.steps} ({unit})"
    print(f"{args.method} {args.mode}, {what}, {median}")
    order = [*totals, *ORDER, *(k for k in stages if k not in ORDER)]
    for label in order:
        values = totals.get(label) or stages.get(label)
        if values:
            print(f"  {label:28s} {statistics.median(values) * 1e3:8.1f} ms")
    ratio = statistics.median(totals["DP step"]) / statistics.median(totals["non-private step"])
    print(f"  DP / non-private: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
