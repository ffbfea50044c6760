"""Speed and memory of a DP SFT step and a DP DPO step on SmolLM2-135M, against TRL and Opacus.

Each configuration (objective × mode × method) trains in a fresh process
(``_post_training_worker.py``; see it for the methods and the batches), in ``--rounds``
interleaved rounds so that drifting load hits every method alike:

- ``trl``: TRL's own ``SFTTrainer`` / ``DPOTrainer`` (non-private, the baseline);
- ``opake``: ``opake.transformers.trl.DPSFTTrainer`` / ``DPDPOTrainer`` (σ = 1, C = 1);
- ``dptrainer-hooks``, ``dptrainer-ghost``: the ``dptrainer`` package (TRL's trainer on top of
  Opacus), run by ``--opacus-python``, the Python of a separate environment holding it.

Workload: SmolLM2-135M-Instruct de-quantised to fp32 (``--model``, see ``_pretrained.py``),
records from Python's documentation cut to exactly ``--seq`` tokens per row (a DPO record is
two rows), ``--batch`` records per step, AdamW, no gradient checkpointing, LoRA rank ``--rank``
on the attention's query and value projections or full fine-tuning. TRL's DPO step runs its
reference forward every step (no precomputed reference), as Opake's does.

Reported per configuration: the wall seconds per step of ``--batch`` records (each run's
median over its timed steps; for Opake's Poisson batches, the timed steps' total over their
records times ``--batch``; then the median over rounds), the median over rounds of the
per-round ratio to ``trl`` (wall and this process's CPU time), and the peak RSS of the process
with its ratio to ``trl``.

    python tools/bench/post_training_step.py --opacus-python PYTHON_WITH_DPTRAINER
    python tools/bench/post_training_step.py --objectives sft --modes lora --rounds 1

Results are recorded in docs/benchmarks.md ("DP post-training").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from _post_training_worker import METHODS, MODES, OBJECTIVES
from _pretrained import resolve_model

WORKER = Path(__file__).resolve().with_name("_post_training_worker.py")
Key = tuple[str, str, str]
#: configurations not run, and why
SKIPPED = {
    "dpo/dptrainer-ghost": (
        "not measured: DPOTrainer computes its own loss, which bypasses dptrainer's "
        "ghost-clipping loss wrapper (dptrainer warns: incorrect privacy gradients)"
    ),
}


def _worker(key: Key, model_dir: str, args: argparse.Namespace) -> dict[str, Any] | str:
    """One run's figures, or a one-line note saying why it failed."""
    objective, mode, method = key
    python = args.opacus_python if method.startswith("dptrainer") else sys.executable
    cmd = [python, str(WORKER), objective, mode, method, "--model-dir", model_dir]
    for flag in ("batch", "seq", "rank", "steps", "warmup", "threads"):
        cmd += [f"--{flag}", str(getattr(args, flag))]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"{'/'.join(key)}: failed ({tail[:240]})"
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(result), file=sys.stderr, flush=True)
    return result


def collect(
    keys: list[Key], model_dir: str, args: argparse.Namespace
) -> tuple[dict[Key, list[dict[str, Any]]], list[str]]:
    """Every configuration ``--rounds`` times, interleaved; a failed one is not retried."""
    runs: dict[Key, list[dict[str, Any]]] = {}
    notes: list[str] = []
    failed: set[Key] = set()
    for _ in range(args.rounds):
        for key in keys:
            if key in failed:
                continue
            result = _worker(key, model_dir, args)
            if isinstance(result, str):
                notes.append(result)
                print(result, file=sys.stderr, flush=True)
                failed.add(key)
            else:
                runs.setdefault(key, []).append(result)
    return runs, notes


def _ratio(runs: list[dict[str, Any]], ref: list[dict[str, Any]], field: str) -> float:
    return float(statistics.median(a[field] / b[field] for a, b in zip(runs, ref, strict=False)))


def table(runs: dict[Key, list[dict[str, Any]]], args: argparse.Namespace) -> list[str]:
    """One markdown row per configuration that ran."""
    head = "| objective | mode | method | s/step wall | ÷ TRL wall | ÷ TRL CPU | peak RSS MiB "
    lines = [head + "| ÷ TRL RSS | rounds |", "|---|---|---|---|---|---|---|---|---|"]
    for objective in args.objectives:
        for mode in args.modes:
            ref = runs.get((objective, mode, "trl"))
            for method in args.methods:
                got = runs.get((objective, mode, method))
                if not got:
                    continue
                wall = statistics.median(r["wall_s"] for r in got)
                rss = max(r["peak_rss_mib"] for r in got)
                cells = [objective.upper(), mode, method, f"{wall:.2f}"]
                if ref:
                    ref_rss = max(r["peak_rss_mib"] for r in ref)
                    cells += [
                        f"{_ratio(got, ref, 'wall_s'):.2f}×",
                        f"{_ratio(got, ref, 'cpu_s'):.2f}×",
                        f"{rss:.0f}",
                        f"{rss / ref_rss:.2f}×",
                    ]
                else:
                    cells += ["—", "—", f"{rss:.0f}", "—"]
                lines.append("| " + " | ".join([*cells, str(len(got))]) + " |")
    return lines


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add = parser.add_argument
    add("--model", default="smollm2", help="smollm2, a GGUF file or a model directory")
    add("--objectives", nargs="+", choices=OBJECTIVES, default=list(OBJECTIVES))
    add("--modes", nargs="+", choices=MODES, default=list(MODES))
    add("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    add("--batch", type=int, default=8, help="records per step (Opake: expected, Poisson)")
    add("--seq", type=int, default=128, help="tokens of every row")
    add("--rank", type=int, default=8, help="LoRA rank")
    add("--steps", type=int, default=6, help="timed steps of every run")
    add("--warmup", type=int, default=1, help="steps of every run left out first")
    add("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    add("--rounds", type=int, default=3)
    add("--opacus-python", default="", help="a Python with dptrainer (for dptrainer-*)")
    add("--json", help="also write the runs here")
    args = parser.parse_args(argv)
    if not args.opacus_python:
        args.methods = [m for m in args.methods if not m.startswith("dptrainer")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    model_dir = resolve_model(args.model)
    keys = [(o, m, x) for o in args.objectives for m in args.modes for x in args.methods]
    skipped = sorted({f"{o}/{x}" for o, _, x in keys} & set(SKIPPED))
    keys = [k for k in keys if f"{k[0]}/{k[2]}" not in SKIPPED]
    runs, notes = collect(keys, model_dir, args)
    notes += [f"{name}: {SKIPPED[name]}" for name in skipped]
    threads = sorted({r["threads"] for rs in runs.values() for r in rs})
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs; torch threads {threads}; "
        f"batch {args.batch} × {args.seq} tokens, LoRA r={args.rank}; {args.steps} timed "
        f"steps after {args.warmup}, {args.rounds} rounds"
    )
    print(f"command: {shlex.join([sys.executable, *sys.argv])}\n")
    print("\n".join(table(runs, args)))
    for note in notes:
        print(f"\n- {note}")
    if args.json:
        report = {"runs": [r for rs in runs.values() for r in rs], "notes": notes}
        Path(args.json).write_text(json.dumps(report, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
