"""How ``dpsgd_step.py`` runs its configurations: one fresh worker process each, in rounds.

A worker is ``dpsgd_step.py --worker MODE METHOD`` (its peak RSS is its own); it prints one JSON
line. ``METHOD@baseline`` runs the same harness with Opake imported from the ``--baseline``
tree (its ``packages/*/src`` first on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from _dpsgd_workload import CONFIG, workload

BASELINE = "@baseline"
SCRIPT = Path(__file__).resolve().with_name("dpsgd_step.py")
Runs = dict[tuple[str, str], list[dict[str, Any]]]


def worker_cmd(python: str, mode: str, method: str, args: argparse.Namespace) -> list[str]:
    """The command line of one worker: ``dpsgd_step.py --worker MODE METHOD`` and the options."""
    cmd = [python, str(SCRIPT), "--worker", mode, method, "--threads", str(args.threads)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device]
    if args.check:
        cmd += ["--check"]
    if args.microbatch_size:
        cmd += ["--microbatch-size", str(args.microbatch_size)]
    if args.model:
        cmd += ["--model", args.model]
    if args.batch:
        cmd += ["--batch", str(args.batch)]
    if args.seq:
        cmd += ["--seq", str(args.seq)]
    return cmd


def run_worker(python: str, mode: str, method: str, args: argparse.Namespace) -> Any:
    """One worker's result (a dict), or a one-line note (a str) saying why it failed."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    label, method = method, method.removesuffix(BASELINE)
    if label != method:  # the same harness, Opake imported from the baseline tree
        roots = sorted(str(p) for p in (args.baseline / "packages").glob("*/src"))
        env["PYTHONPATH"] = os.pathsep.join([*roots, env.get("PYTHONPATH", "")]).rstrip(":")
    proc = subprocess.run(
        worker_cmd(python, mode, method, args),
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"{mode}/{method}: failed ({tail[:200]})"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["method"] = label
    print(json.dumps(result), file=sys.stderr)
    return result


def _opacus_missing(python: str) -> bool:
    probe = subprocess.run(
        [python, "-c", "import opacus"], capture_output=True, text=True, check=False
    )
    return probe.returncode != 0


def collect(configs: list[tuple[str, str]], args: argparse.Namespace) -> tuple[Runs, list[str]]:
    """Run every configuration ``--rounds`` times, interleaved (drifting load hits all alike)."""
    runs: Runs = {}
    notes: list[str] = []
    skipped: set[tuple[str, str]] = set()
    for _ in range(args.rounds):
        for mode, method in configs:
            if (mode, method) in skipped:
                continue
            python = args.opacus_python if method.startswith("opacus") else sys.executable
            if method.startswith("opacus") and _opacus_missing(python):
                notes.append(f"{mode}/{method}: skipped (opacus not importable in {python})")
                skipped.add((mode, method))
                continue
            result = run_worker(python, mode, method, args)
            if isinstance(result, str):
                notes.append(result)
                print(result, file=sys.stderr)
                skipped.add((mode, method))
                continue
            runs.setdefault((mode, method), []).append(result)
    return runs, notes


def summary(runs: list[dict[str, Any]], ref: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Median over rounds; ratios are per round (same load) then the median."""
    out = dict(runs[0])
    out["wall_s"] = statistics.median(r["wall_s"] for r in runs)
    out["cpu_s"] = statistics.median(r["cpu_s"] for r in runs)
    out["peak_rss_mib"] = max(r["peak_rss_mib"] for r in runs)
    out["rounds"] = len(runs)
    if "peak_cuda_mib" in out:
        out["peak_cuda_mib"] = max(r["peak_cuda_mib"] for r in runs)
        if ref and "peak_cuda_mib" in ref[0]:
            out["ratio_cuda"] = out["peak_cuda_mib"] / max(r["peak_cuda_mib"] for r in ref)
    if ref:
        pairs = list(zip(runs, ref, strict=False))
        out["ratio_wall"] = statistics.median(a["wall_s"] / b["wall_s"] for a, b in pairs)
        out["ratio_cpu"] = statistics.median(a["cpu_s"] / b["cpu_s"] for a, b in pairs)
        out["ratio_rss"] = out["peak_rss_mib"] / max(r["peak_rss_mib"] for r in ref)
    return out


def cuda_cells(result: dict[str, Any]) -> str:
    """The table's two CUDA cells of one summary: peak MiB and the ratio to non-private."""
    peak = result.get("peak_cuda_mib")
    ratio = result.get("ratio_cuda")
    peak_cell = "–" if peak is None else f"{peak:.0f}"
    ratio_cell = "–" if ratio is None else f"{ratio:.2f}"
    return f" {peak_cell} | {ratio_cell} |"


def header(args: argparse.Namespace) -> None:
    """The machine, the interpreter and the workload, above every table."""
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}")
    print(
        f"python {platform.python_version()}, threads {args.threads}, steps {args.steps}, "
        f"rounds {args.rounds}"
    )
    if not args.check:
        work = workload(args)
        model = args.model_label or f"Llama {CONFIG}"
        print(f"model: {model}, batch {work.batch} × sequence {work.seq}, device {args.device}")
    print()


def print_baseline_ratios(results: list[dict[str, Any]]) -> None:
    """One line per method that ran against ``--baseline``: its median per-round ratios."""
    for r in results:
        if "vs_baseline_cpu" in r:
            print(
                f"\n- {r['mode']}/{r['method']} vs its baseline: "
                f"{r['vs_baseline_cpu']:.4f}× CPU, {r['vs_baseline_wall']:.4f}× wall "
                "(median of per-round ratios)"
            )


def plain(runs: Runs) -> dict[str, Any]:
    """*runs* keyed ``"mode/method"`` (JSON keys are strings)."""
    return {f"{mode}/{method}": value for (mode, method), value in runs.items()}
