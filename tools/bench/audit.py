"""Privacy audits: the resolution table (simulation) and `opake audit` at ε ∈ {1, 2, 4, 8}.

    python tools/bench/audit.py simulate                 # lower bound an ideal Gaussian allows
    python tools/bench/audit.py whitebox                 # gradient canaries at opake train's q
    python tools/bench/audit.py whitebox --engine vmap   # ... through the vmap engine
    python tools/bench/audit.py runs                     # opake audit, white-box and black-box
    python tools/bench/audit.py runs --kinds gradient --epsilons 8 -- --steps 60

``simulate``: for m canaries and a true ε (δ = 1e-5), the median over ``--reps`` seeds of the
lower bound that ``opake.auditing.simulate_gaussian_audit`` proves about an exactly (ε, δ)-DP
Gaussian mechanism (each canary's score μ·[in] + N(0, 1)), and the bound with perfect guesses
(what m canaries can show at most), both at 95 % confidence with the default guess grid.

``runs``: ``opake audit`` in a fresh process per (canary kind, ε) with ``--target-epsilon ε``
(everything else the defaults of ``opake train``), its wall time and the child's CPU time
(user + system), and the figures of ``audit.json`` (``--keep DIR`` keeps each run's outputs). One
Markdown table. Results are
recorded in docs/benchmarks.md ("Privacy audit (opake audit)").
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def simulate(canaries: list[int], epsilons: list[float], reps: int) -> None:
    import numpy as np

    from opake.auditing import draw_inclusion, one_run_audit, simulate_gaussian_audit

    heads = " | ".join(f"true ε = {e:g}" for e in epsilons)
    print(f"| canaries m | {heads} | perfect guesses |")
    print("|---:|" + "---:|" * (len(epsilons) + 1))
    for m in canaries:
        cells = []
        for eps in epsilons:
            bounds = [
                simulate_gaussian_audit(eps, canaries=m, seed=1000 * m + s).epsilon_lower_bound
                for s in range(reps)
            ]
            cells.append(f"{statistics.median(bounds):.2f}")
        included = draw_inclusion(m, seed=m)
        perfect = one_run_audit(
            np.asarray(included, dtype=float), included, claimed_epsilon=0.0, delta=1e-5
        )
        cells.append(f"{perfect.epsilon_lower_bound:.2f}")
        print(f"| {m} | " + " | ".join(cells) + " |", flush=True)


def whitebox(epsilons: list[float], args: argparse.Namespace) -> None:
    """Gradient canaries at the sampling of a given run, through opake-core's ``DPTraining``.

    The canaries are examples of their own audit layer, which the data's gradients never
    touch, clipped by the engine the data goes through (book-keeping with ``--engine auto`` on
    the self-test's full model, or vmap), a quarter plain and three quarters crafted against
    book-keeping's numerics; their scores depend on q, the steps, σ, C and m only — not on the
    model: this is the white-box part of ``opake audit`` at the same q, steps and δ, without the
    language model's cost.
    """
    from opake.auditing import self_test

    print(
        "| claimed ε | lower bound (95 %) | correct / guesses | attack | canaries | engine | CPU |"
    )
    print("|---:|---:|---:|---|---|---|---:|")
    for eps in epsilons:
        cpu0 = time.process_time()
        result = self_test(
            epsilon=eps,
            delta=args.delta,
            canaries=args.canaries,
            dataset_size=args.dataset_size,
            sample_rate=args.sample_rate,
            steps=args.steps,
            engine=args.engine,
            seed=args.seed,
        )
        cpu = time.process_time() - cpu0
        print(
            f"| {result.claimed_epsilon:.3f} | {result.epsilon_lower_bound:.3f} | "
            f"{result.correct} / {result.guesses} | {result.attack} | {result.group} "
            f"| {result.engine} | {cpu:.0f} s |",
            flush=True,
        )


def _child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def runs(kinds: list[str], epsilons: list[float], extra: list[str], keep: Path | None) -> None:
    print(
        "| canaries | claimed ε | lower bound | confidence | correct / guesses | attack | m "
        "| steps | σ | q | wall | CPU |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for kind in kinds:
        for eps in epsilons:
            with tempfile.TemporaryDirectory() as tmp:
                out = (keep if keep is not None else Path(tmp)) / f"audit-{kind}-{eps:g}"
                cmd = [
                    sys.executable,
                    "-m",
                    "opake.cli",
                    "audit",
                    "--canaries",
                    kind,
                    "--target-epsilon",
                    str(eps),
                    "--no-progress",
                    "--out",
                    str(out),
                    *extra,
                ]
                cpu0, t0 = _child_cpu(), time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
                wall, cpu = time.perf_counter() - t0, _child_cpu() - cpu0
                if proc.returncode != 0:
                    print(proc.stdout + proc.stderr, file=sys.stderr)
                    raise SystemExit(f"opake audit failed ({kind}, ε = {eps})")
                data = json.loads((out / "audit.json").read_text())
            print(
                f"| {kind} | {data['claimed_epsilon']:.3f} | {data['epsilon_lower_bound']:.3f} "
                f"| {data['confidence']:.2f} | {data['correct']} / {data['guesses']} "
                f"| {data['attack']} | {data['canaries']} | {data['steps']} "
                f"| {data['noise_multiplier']:.3f} | {data['sample_rate']:.4g} | {wall:.0f} s "
                f"| {cpu:.0f} s |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("simulate")
    s.add_argument("--canaries", type=int, nargs="+", default=[100, 1000, 10000])
    s.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    s.add_argument("--reps", type=int, default=11)
    r = sub.add_parser("runs")
    r.add_argument("--kinds", nargs="+", default=["gradient", "input"])
    r.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    r.add_argument("--keep", type=Path, default=None, help="keep each run's outputs here")
    r.add_argument("extra", nargs="*", help="extra arguments for opake audit (after --)")
    w = sub.add_parser("whitebox")
    w.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    # the default opake train run: 6,556 blocks, q = 128 / 6,556, 240 steps, δ = 1/N²
    w.add_argument("--dataset-size", type=int, default=6556)
    w.add_argument("--sample-rate", type=float, default=128 / 6556)
    w.add_argument("--steps", type=int, default=240)
    w.add_argument("--delta", type=float, default=1 / 6556**2)
    w.add_argument("--canaries", type=int, default=1000)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--engine", choices=["auto", "vmap", "bookkeeping"], default="auto")
    args = parser.parse_args()
    print(f"# {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    if args.what == "simulate":
        simulate(args.canaries, args.epsilons, args.reps)
    elif args.what == "whitebox":
        whitebox(args.epsilons, args)
    else:
        runs(args.kinds, args.epsilons, args.extra, args.keep)


if __name__ == "__main__":
    main()
