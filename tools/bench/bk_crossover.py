"""Time the book-keeping engine's two routes to a linear layer's per-example squared norm.

    python tools/bench/bk_crossover.py                       # the recorded grid, markdown tables
    python tools/bench/bk_crossover.py --json crossover.json
    python tools/bench/bk_crossover.py --widths 256 --steps 64 128 --repeats 7 --no-memory

A linear layer with input width d and output width p, applied to B sequences of T tokens, has
per-example gradients ``G_i = Σ_t g_{i,t} ⊗ x_{i,t}`` (a ``p × d`` matrix). The engine
(choosing with :func:`opake.dpsgd.bookkeeping.ghost_is_cheaper`) gets ``‖G_i‖²`` one of two ways:

* **ghost** (Gram identity): ``Σ_{t,s} (g_t·g_s)(x_t·x_s)`` — ``opake.dpsgd.certify.gram``
  of both sides, two ``[B, T, T]`` Gram matrices, about ``2·B·T²·(d + p)`` flops;
* **materialised**: ``einsum`` of the two sides (the ``[B, p, d]`` per-example gradients) then
  ``vector_norm`` — about ``2·B·T·d·p`` flops.

``auto`` picks ghost while ``ghost_is_cheaper(T, p, d)`` holds, i.e. ``T·(d + p) ≤ d·p`` (the
flop balance; crossover ``T* = d·p / (d + p)``; it replaced MixOpt's memory rule ``2T² ≤ d·p``
after this script's first run showed that one switching 1.1–2.1× too late). This script times
both routes on a grid of (width, T) in this process (one torch thread, fp32, random ``g`` and
``x``; the median of ``--repeats`` calls after ``--warmup``, as process CPU time and wall time),
and reports for each width the first grid T at which the materialised route is faster next to
the rule's switch.

Memory: the analytic extra floats of each route (ghost: the two Gram matrices, multiplied in
place, ``2·B·T²``; materialised: ``B·d·p``), and, unless
``--no-memory``, the measured peak: one child process with ``MALLOC_MMAP_THRESHOLD_=131072`` (so a
freed tensor leaves the resident set at once) runs each route once per point and reads the
kernel's peak-RSS mark (``VmHWM``, reset through ``/proc/self/clear_refs`` just before the call)
minus the resident size before it. Points whose materialised tensor or Gram pair exceeds
``--max-bytes`` are skipped.

Results are recorded in docs/benchmarks.md ("Book-keeping engine", "Ghost vs materialised
crossover").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MIB = 1 << 20
WIDTHS = (64, 128, 256, 512, 1024)  # d = p
RECTANGULAR = ((256, 4096),)  # (d, p): an lm_head of hidden 256, vocabulary 4096
STEPS = (16, 32, 64, 128, 256, 512, 1024, 2048)


def _shapes(args: argparse.Namespace) -> list[tuple[int, int]]:
    shapes = [(w, w) for w in args.widths]
    for spec in args.rect:
        d, p = spec.split("x")
        shapes.append((int(d), int(p)))
    return shapes


def _fits(batch: int, steps: int, d: int, p: int, limit: float) -> bool:
    return batch * d * p * 4 <= limit and batch * steps * steps * 4 * 2 <= limit


def _routes(batch: int, steps: int, d: int, p: int) -> dict[str, Callable[[], Any]]:
    """The two norm routes over one random piece (output grads ``[B,T,p]``, inputs ``[B,T,d]``)."""
    import torch

    from opake.dpsgd.bookkeeping import OuterSum
    from opake.dpsgd.certify import gram

    gen = torch.Generator().manual_seed(steps * 7919 + d * 31 + p)
    piece = OuterSum(
        torch.randn(batch, steps, p, generator=gen), torch.randn(batch, steps, d, generator=gen)
    )

    def ghost() -> Any:  # the engine's Gram products (fp32 blocks summed in fp64)
        return gram(piece.a).mul_(gram(piece.b)).sum(dim=(1, 2))

    def materialised() -> Any:
        g = torch.einsum("btp,btd->bpd", piece.a, piece.b)
        return torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1).square()

    return {"ghost": ghost, "materialised": materialised}


def _time(fn: Callable[[], Any], warmup: int, repeats: int) -> tuple[float, float]:
    for _ in range(warmup):
        fn()
    cpu, wall = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return statistics.median(cpu), statistics.median(wall)


def _status(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def memory_worker(args: argparse.Namespace) -> dict[str, dict[str, float | None]]:
    """Measured peak extra MiB of each route at each point (run in the child process)."""
    import gc

    import torch

    torch.set_num_threads(1)
    out: dict[str, dict[str, float | None]] = {}
    for d, p in _shapes(args):
        for steps in args.steps:
            if not _fits(args.batch, steps, d, p, args.max_bytes):
                continue
            routes = _routes(args.batch, steps, d, p)
            point: dict[str, float | None] = {}
            for name, fn in routes.items():
                fn()  # warm-up: BLAS workspaces, first-touch allocations
                gc.collect()
                before = _status("VmRSS")
                if not _reset_peak():
                    point[name] = None
                    continue
                result = fn()
                point[name] = (_status("VmHWM") - before) / MIB
                del result
            out[f"{d}x{p}x{steps}"] = point
    return out


def _measure_memory(args: argparse.Namespace) -> dict[str, dict[str, float | None]]:
    cmd = [sys.executable, __file__, "--memory-worker", "--batch", str(args.batch)]
    cmd += ["--widths", *map(str, args.widths), "--steps", *map(str, args.steps)]
    cmd += ["--max-bytes", str(args.max_bytes)]
    if args.rect:
        cmd += ["--rect", *args.rect]
    else:
        cmd += ["--rect"]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"memory worker failed:\n{proc.stderr[-2000:]}")
    peaks: dict[str, dict[str, float | None]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return peaks


def _machine() -> dict[str, Any]:
    import torch

    cpu = "?"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "load_start": os.getloadavg(),
    }


def _crossover(points: list[dict[str, Any]], key: str) -> tuple[int | None, float | None]:
    """First grid T where materialised beats ghost on ``key``; and a log-log interpolated T."""
    prev = None
    for pt in points:
        ratio = pt[f"materialised_{key}"] / pt[f"ghost_{key}"]  # < 1: materialised faster
        if ratio < 1:
            if prev is None:
                return pt["T"], None
            t0, r0 = prev
            t1, r1 = pt["T"], ratio
            # straight line in (log T, log ratio) through both points, solved for ratio = 1
            frac = math.log(r0) / (math.log(r0) - math.log(r1))
            return pt["T"], math.exp(math.log(t0) + frac * (math.log(t1) - math.log(t0)))
        prev = (pt["T"], ratio)
    return None, None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--widths", nargs="+", type=int, default=list(WIDTHS), help="d = p")
    parser.add_argument(
        "--rect",
        nargs="*",
        default=[f"{d}x{p}" for d, p in RECTANGULAR],
        help="rectangular layers as DxP (input x output width)",
    )
    parser.add_argument("--steps", nargs="+", type=int, default=list(STEPS), help="values of T")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls (median; ≥ 5)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--max-bytes", type=float, default=1.5 * 1024**3)
    parser.add_argument("--no-memory", action="store_true", help="skip the measured peaks")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--memory-worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def _measure_times(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each (d, p, T) point: both routes' CPU and wall medians, and the rule's choice."""
    from opake.dpsgd.bookkeeping import ghost_is_cheaper

    results: list[dict[str, Any]] = []
    for d, p in _shapes(args):
        for steps in args.steps:
            if not _fits(args.batch, steps, d, p, args.max_bytes):
                print(f"skip d={d} p={p} T={steps}: over --max-bytes", file=sys.stderr)
                continue
            row: dict[str, Any] = {"d": d, "p": p, "T": steps, "batch": args.batch}
            for name, fn in _routes(args.batch, steps, d, p).items():
                row[f"{name}_cpu_s"], row[f"{name}_wall_s"] = _time(fn, args.warmup, args.repeats)
            row["rule"] = "ghost" if ghost_is_cheaper(steps, p, d) else "materialised"
            row["ghost_floats"] = 2 * args.batch * steps * steps
            row["materialised_floats"] = args.batch * d * p
            results.append(row)
            print(json.dumps(row), file=sys.stderr)
    return results


def _mib(floats: int, measured: float | None) -> str:
    got = "–" if measured is None else f"{measured:.1f}"
    return f"{floats * 4 / MIB:.1f}, {got}"


def _print_points(
    results: list[dict[str, Any]], machine: dict[str, Any], args: argparse.Namespace
) -> None:
    load = ", ".join(f"{x:.1f}" for x in machine["load_start"])
    print(
        f"python {machine['python']}, torch {machine['torch']}, {machine['cpu']}, "
        f"{machine['cores']} cores, 1 torch thread, load average at start {load}; "
        f"B = {args.batch}, fp32, median of {args.repeats} calls after {args.warmup} warm-up"
    )
    print()
    print(
        "| d × p | T | ghost CPU ms | materialised CPU ms | mat./ghost (CPU) |"
        " mat./ghost (wall) | faster | `auto` picks | ghost extra MiB (2BT², measured) |"
        " materialised extra MiB (Bdp, measured) |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---|---:|---:|")
    for row in results:
        ratio_cpu = row["materialised_cpu_s"] / row["ghost_cpu_s"]
        ratio_wall = row["materialised_wall_s"] / row["ghost_wall_s"]
        print(
            f"| {row['d']} × {row['p']} | {row['T']} | {1e3 * row['ghost_cpu_s']:.2f} | "
            f"{1e3 * row['materialised_cpu_s']:.2f} | {ratio_cpu:.2f} | {ratio_wall:.2f} | "
            f"{'materialised' if ratio_cpu < 1 else 'ghost'} | {row['rule']} | "
            f"{_mib(row['ghost_floats'], row['ghost_peak_mib'])} | "
            f"{_mib(row['materialised_floats'], row['materialised_peak_mib'])} |"
        )
    print()


def _show(x: float | None, beyond: str) -> str:
    return beyond if x is None else f"{x:.0f}"


def _print_crossovers(
    results: list[dict[str, Any]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Per layer shape: where the rule switches routes and where the measurement does."""
    print(
        "| d × p | rule T* = dp/(d+p) | rule switches at grid T | measured: materialised"
        " faster from grid T (CPU) | interpolated T (CPU) | interpolated T (wall) |"
        " measured / rule |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    summary = []
    for d, p in _shapes(args):
        points = [r for r in results if (r["d"], r["p"]) == (d, p)]
        if not points:
            continue
        t_rule = d * p / (d + p)
        rule_grid = next((r["T"] for r in points if r["rule"] == "materialised"), None)
        grid_cpu, interp_cpu = _crossover(points, "cpu_s")
        _, interp_wall = _crossover(points, "wall_s")
        factor = interp_cpu / t_rule if interp_cpu else None
        summary.append(
            {
                "d": d,
                "p": p,
                "rule_T": t_rule,
                "rule_grid_T": rule_grid,
                "measured_grid_T": grid_cpu,
                "measured_T_cpu": interp_cpu,
                "measured_T_wall": interp_wall,
                "measured_over_rule": factor,
            }
        )
        beyond = f"> {points[-1]['T']}"
        print(
            f"| {d} × {p} | {t_rule:.0f} | {_show(rule_grid, beyond)} | "
            f"{_show(grid_cpu, beyond)} | {_show(interp_cpu, '–')} | "
            f"{_show(interp_wall, '–')} | {'–' if factor is None else f'{factor:.2f}'} |"
        )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.repeats < 5:
        parser.error("--repeats must be at least 5 (the median of ≥ 5 calls is reported)")
    for spec in args.rect:
        parts = spec.split("x")
        if len(parts) != 2 or not all(x.isdigit() for x in parts):
            parser.error(f"--rect {spec!r}: expected DxP, e.g. 256x4096")
    if args.memory_worker:
        print(json.dumps(memory_worker(args)))
        return 0

    import torch

    torch.set_num_threads(1)
    machine = _machine()
    results = _measure_times(args)
    machine["load_end"] = os.getloadavg()
    memory = {} if args.no_memory else _measure_memory(args)
    for row in results:
        peak = memory.get(f"{row['d']}x{row['p']}x{row['T']}", {})
        row["ghost_peak_mib"] = peak.get("ghost")
        row["materialised_peak_mib"] = peak.get("materialised")
    _print_points(results, machine, args)
    summary = _print_crossovers(results, args)
    if args.json:
        payload: dict[str, Any] = {
            "machine": machine,
            "args": vars(args) | {"json": str(args.json)},
            "points": results,
            "summary": summary,
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
